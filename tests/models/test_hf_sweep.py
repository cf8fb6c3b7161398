"""bench/hf_sweep.py's architectures (32 of HF transformers' families, tiny configs, random weights) compiled with
resfuse under the interpreter against eager: each runs, within 1e-4 of eager, with nothing fallen back; and one
training step of five of them, gradients included. The sweep found OPT's and Qwen2-MoE's crash at their first call."""
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("hf_sweep", Path(__file__).parents[2] / "bench" / "hf_sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


@pytest.mark.parametrize("name", sweep.CASES)
def test_an_architecture_compiles_and_matches_eager(name):
    if sweep.model_class(name) is None:
        pytest.skip(f"{sweep.CASES[name][0]} is not in this transformers")
    (err, where), report = sweep.check_eval(name)
    assert report.errors == [] and err <= sweep.WRONG, (where, err, report.errors)


@pytest.mark.parametrize("name", sweep.TRAIN)
def test_a_training_step_matches_eager(name):
    (err, where), report = sweep.check_train(name)
    assert report.errors == [] and err <= sweep.WRONG, (where, err, report.errors)
