"""One GRPO step on a megatron GPTModel (``megatron.train``) on CUDA against
``PolicyTrainer.train_step`` on the HF model from the same folder, in a process of its own
(a world of one): ``tests/integration/test_cuda_paths.py::test_megatron_grpo_step_matches_the_single_trainer_on_cuda``
runs it (``python -m tests.scripts.megatron_step_cuda <model folder>``); prints both grad
norms, both losses and the largest difference of the updated weights."""

from __future__ import annotations

import sys

import torch


def main(argv: list[str]) -> None:
    folder = argv[0]
    from gpu_runtime.trainer.common.device import use_device

    use_device("cuda:0")
    from gpu_runtime.store.artifacts import Sample
    from gpu_runtime.trainer.megatron import model as mm
    from gpu_runtime.trainer.megatron.train import grpo_step
    from gpu_runtime.trainer.policy.trainer import PolicyTrainer
    from spec.train import TrainSpec

    hp = TrainSpec(lr=1e-4, micro_batch_size=4)
    samples = [Sample(sample_id=f"s1-p0-g{g}", prompt_index=0, group_index=g, prompt_ids=[1, 5, 6],
                      response_ids=[7, 8, 9 + g][: 1 + g % 3], logprobs=[-1.0] * (1 + g % 3), weight_version=0,
                      finish_reason="length") for g in range(4)]
    rewards = [1.0, 0.0, 0.5, 0.0]
    ref = PolicyTrainer.create(folder, hp, 0)
    want = ref.train_step(samples, rewards, 4, hp)
    mm.init_single_process()
    gpt, cfg = mm.from_folder(folder)
    gpt = gpt.cuda().float()
    opt = torch.optim.AdamW(gpt.parameters(), lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay,
                            foreach=False)
    got = grpo_step(gpt, opt, samples, rewards, 4, hp, ref.tokenizer.pad_token_id)
    after = mm.export_hf_weights(gpt, cfg)
    mine = ref.published_state()
    diff = max(float((after[k].float() - mine[k].float()).abs().max()) for k in mine)
    print(want["grad_norm"], got["grad_norm"], want["loss"], got["loss"], diff)


if __name__ == "__main__":
    main(sys.argv[1:])
