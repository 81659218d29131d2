"""wanexp.train builds one run context and hands that same object to the datamodule, the module and the callbacks
that read it (wanexp/context.py)."""
from __future__ import annotations

from wanexp.context import RunContext, TakesRunContext


def test_one_context_reaches_the_datamodule_the_module_and_the_callbacks(trained):
    r = trained("tiny")  # shared with the other integration tests of the tiny layout
    module, trainer, cfg = r["module"], r["trainer"], r["cfg"]
    ctx = module.run_context
    assert ctx == RunContext(sp_size=int(cfg.parallel.sp_size), concurrent_loads=cfg.parallel.concurrent_loads)
    assert trainer.datamodule.run_context is ctx
    takers = [c for c in trainer.callbacks if isinstance(c, TakesRunContext)]
    assert takers and all(c.run_context is ctx for c in takers)
    assert not hasattr(trainer.strategy, "sp_size")  # nothing is hung on Lightning's objects
