"""Small helpers with no engine concept of their own.

  keyed_lock.py    one lock per key (equal bytes decoded once, an item preprocessed once)
  host_memory.py   how much host memory a tier or a CPU KV cache may take
  lazy_exports.py  package attributes imported on first use
  heap.py          a serving process's start-up objects frozen out of the garbage collector's full passes
  collector_pace.py how often a serving process's garbage collector runs its young passes
  ids.py           request and response ids without a system call
  process_exit.py  how a spawned mmengine process ends once it has stopped (no interpreter teardown)
  stand_in_import.py  one of transformers' modules imported without a heavy module it imports for a name
"""
