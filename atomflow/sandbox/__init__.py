"""The sandbox (docs/SANDBOX.md): paged KV attention, a block manager and iteration-level batching,
built from the same kernels as the engine in a second extension (atomflow._sandbox).

  model.py      the extension, SandboxModel (GPU) and FakeModel (CPU stand-in)
  scheduler.py  iteration-level batching over the paged pool
  bench.py      the measurements behind docs/SANDBOX.md
  selftest.py   `atomflow sandbox test-blocks`
  cli.py        the `atomflow sandbox ...` subcommands
"""
