"""One GRPO step of the single trainer on a device, in a process of its own (the default
device is set once, before the trainer is built):
``tests/integration/test_cuda_paths.py::test_cuda_trainer_is_bitwise_repeatable_and_close_to_cpu``
runs it (``python -m tests.scripts.cuda_train_step <model folder> cuda:0|cpu``); prints the
weights' checksum and the step's grad norm."""

from __future__ import annotations

import sys

import torch


def main(argv: list[str]) -> None:
    folder, device = argv[0], argv[1]
    from gpu_runtime.trainer.common.device import use_device

    use_device(device)
    torch.use_deterministic_algorithms(True)
    from gpu_runtime.store.artifacts import Sample
    from gpu_runtime.trainer.policy.trainer import PolicyTrainer
    from spec.train import TrainSpec

    hp = TrainSpec(lr=1e-3, micro_batch_size=2)
    t = PolicyTrainer.create(folder, hp, 0)
    assert next(t.model.parameters()).device.type == device.split(":")[0]
    samples = [Sample(sample_id=f"s1-p0-g{g}", prompt_index=0, group_index=g, prompt_ids=[1, 5, 6],
                      response_ids=[7, 8, 9 + g], logprobs=[-1.0] * 3, weight_version=0, finish_reason="length")
               for g in range(4)]
    m = t.train_step(samples, [1.0, 0.0, 0.5, 0.0], 4, hp)
    print(t.checksum(), repr(m["grad_norm"]))


if __name__ == "__main__":
    main(sys.argv[1:])
