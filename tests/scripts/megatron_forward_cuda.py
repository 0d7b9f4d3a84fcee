"""megatron-core's GPTModel forward on CUDA against the HF model from the same folder, in a
process of its own (a world of one):
``tests/integration/test_cuda_paths.py::test_megatron_forward_matches_hf_on_cuda`` runs it
(``python -m tests.scripts.megatron_forward_cuda <model folder>``); prints the largest
difference of their logits."""

from __future__ import annotations

import sys

import torch


def main(argv: list[str]) -> None:
    folder = argv[0]
    from gpu_runtime.models.causal_lm import load_causal_lm
    from gpu_runtime.trainer.megatron import model as mm

    mm.init_single_process()
    gpt, cfg = mm.from_folder(folder)
    gpt = gpt.cuda().float()
    hf = load_causal_lm(folder).cuda()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]], device="cuda")
    pos = torch.arange(6, device="cuda")[None]
    with torch.no_grad():
        a = gpt(input_ids=ids, position_ids=pos, attention_mask=None).float()
        b = hf(input_ids=ids).logits.float()
    print(float((a - b).abs().max()))


if __name__ == "__main__":
    main(sys.argv[1:])
