"""mmengine on Ray: offline batches on Ray Data, and online serving on Ray Serve."""
