"""`resfuse bench`: measure resfuse against eager and torch.compile on a model, next to a roofline floor.

Stages, in the order a run uses them: models.py (name -> model, inputs), roofline.py (per-layer floor
from FLOPs and minimal bytes), timing.py (latency, first-call time, numerics, profiles), run.py (the CLI
entry points `add_arguments` / `main`, one peer at a time), report.py (rich table, JSON, PNG plot).
"""
