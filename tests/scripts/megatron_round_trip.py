"""A megatron-core GPTModel (local spec) built on CPU from an HF folder, in a process of its
own (a world of one): it takes the converted weights strictly and gives them back bitwise.
``tests/unit/test_megatron_convert.py::test_a_real_gpt_model_takes_the_weights_and_gives_them_back``
runs it (``python -m tests.scripts.megatron_round_trip <model folder>``); prints ``OK <tensors>``."""

from __future__ import annotations

import sys
import warnings

import torch


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore")
    from safetensors.torch import load_file

    from gpu_runtime.trainer.megatron import model as mm

    mm.init_single_process()
    gpt, cfg = mm.from_folder(argv[0], cpu_init=True)
    assert gpt.config.num_query_groups == cfg.num_key_value_heads
    back = mm.export_hf_weights(gpt, cfg)
    ref = load_file(argv[0] + "/model.safetensors")
    assert set(back) == set(ref), (sorted(set(back) ^ set(ref)))
    bad = [k for k in ref if not torch.equal(back[k], ref[k])]
    assert not bad, bad
    print("OK", len(ref))


if __name__ == "__main__":
    main(sys.argv[1:])
