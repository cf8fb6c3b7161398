"""`resfuse explain` end to end on a small file.py:factory model, and its error path."""
import textwrap

from resfuse import cli


def test_explain_prints_report_numerics_and_floor(tmp_path, capsys):
    f = tmp_path / "tiny.py"
    f.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        def make():
            m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                              nn.Flatten(), nn.Linear(8 * 6 * 6, 4), nn.GELU())
            return m.eval(), (torch.randn(2, 3, 6, 6),)
    """))
    assert cli.main(["explain", f"{f}:make"]) == 0
    out = capsys.readouterr().out
    assert "conv2d_bias_bn_relu" in out and "gemm_bias_gelu" in out
    assert "resfuse vs eager relative error" in out and "paths that ran: reference" in out
    assert "where the time would go" in out


def test_explain_unknown_model_exits_2(capsys):
    assert cli.main(["explain", "no-such-model"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_cache_commands_round_trip(tmp_path, capsys):
    from resfuse.config import Config
    from resfuse.tuning.cache import Entry, TuningCache

    from .tuning.test_cache import KEY

    TuningCache(f"{Config.from_env().cache_dir}/tuning.sqlite").put(KEY, Entry("aten", {}, {"aten": 2e-5}))
    assert cli.main(["cache", "list"]) == 0
    listing = capsys.readouterr().out
    assert "conv2d" in listing and "aten" in listing
    assert cli.main(["cache", "export", str(tmp_path / "c.json")]) == 0
    assert cli.main(["cache", "clear"]) == 0 and "removed 1" in capsys.readouterr().out
    assert cli.main(["cache", "import", str(tmp_path / "c.json")]) == 0
    assert "imported 1" in capsys.readouterr().out
