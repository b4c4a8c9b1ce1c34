"""`python -m mmengine`: the same as the `mmengine` command."""

from mmengine.cli import console_main

console_main()
