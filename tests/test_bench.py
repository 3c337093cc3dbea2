"""The training benchmark's own accounting: its two FLOP counts (real tokens per example,
and the padded shapes its ceiling times) must agree where nothing is padded."""

import pytest


@pytest.mark.parametrize(("passes", "warm"), [(1, 0), (3, 0), (2, 1)])
def test_shape_ceiling_counts_the_flops_useful_flops_counts_on_unpadded_rows(passes, warm):
    from bench.train import shape_ceiling, useful_flops
    from fbt_probe.train.recipes import named_config
    from fbt_probe.train.steps import plan_of

    cfg = named_config("tiny")
    examples = cfg.stream().batch(0, 16, plan_of(cfg, 0).tasks, 8)
    n = len(examples[0].tokens)
    examples = [ex for ex in examples if len(ex.tokens) == n]  # one length: no padding
    assert examples
    useful = useful_flops(cfg, examples, passes, warm, True, grad_only=True)
    sample = {
        "shapes": [(len(examples), n, passes, passes if warm else passes - 1)],
        "seconds": 1.0,
        "warm_states_s": 0.0,
        "useful_grad_flops": useful,
    }
    out = shape_ceiling(cfg, sample, peak=1e11)
    assert out["ops_flops"] == pytest.approx(useful, rel=1e-12)
    assert out["ops_alone_s"] >= 0 and 0 < out["attention_share_of_time"] < 1
    assert out["useful_ceiling_fraction_of_peak"] == pytest.approx(
        out["ops_alone_fraction_of_peak"], abs=2e-3
    )
