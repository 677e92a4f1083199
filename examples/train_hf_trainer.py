"""Fine-tune a Hugging Face Llama with ``transformers.Trainer`` and gemini underneath.

    python examples/train_hf_trainer.py
    python examples/train_hf_trainer.py --device cuda --budget 8GiB --weights path/to/llama --steps 100
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py    # ZeRO over two processes

The model is built on the meta device (``accelerate.init_empty_weights``: no memory), its
weights streamed from safetensors chunk group by chunk group straight into gemini's chunks
(here a checkpoint this script first writes from a small random Llama; ``--weights`` takes a
real one, a folder as ``save_pretrained`` writes it). ``GeminiTrainer`` then trains it like
``transformers.Trainer`` would — learning rate schedule with warm-up, gradient accumulation,
clipping, logging — under a device budget below the model's data, and ``save_model`` writes
safetensors that ``from_pretrained`` loads. Under torchrun each process is a rank of gemini's
ZeRO (its share of the chunks, its share of each batch), as DeepSpeed's ZeRO is under Trainer. Needs ``pip install 'gemini-offload[hf]'``; without
it the script says so and exits cleanly.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import gemini
from gemini.tools.cli_options import POSITIVE, byte_size


class _Tokens(torch.utils.data.Dataset):
    """Random token rows for causal language modelling (labels = inputs; the model shifts them)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--weights", default=None, help="a Llama checkpoint folder (default: write a small random one)")
    p.add_argument("--layers", type=POSITIVE, default=4, help="layers of the random Llama (default: %(default)s)")
    p.add_argument("--hidden", type=POSITIVE, default=256, help="hidden size of the random Llama (default: %(default)s)")
    p.add_argument("--vocab", type=POSITIVE, default=2048, help="vocabulary of the random Llama (default: %(default)s)")
    p.add_argument("--seq", type=POSITIVE, default=32, help="tokens per row (default: %(default)s)")
    p.add_argument("--steps", type=POSITIVE, default=6, help="optimizer steps (default: %(default)s)")
    p.add_argument("--budget", type=byte_size, default="16MiB", help="GeminiConfig.device_memory (default: %(default)s)")
    p.add_argument("--out", default=None, help="output folder (default: a temporary one)")
    args = p.parse_args(argv)
    if args.weights is not None and not Path(args.weights).is_dir():
        p.error(f"--weights {args.weights!r} is not a folder (a Llama checkpoint folder is expected)")
    try:
        import transformers
        from accelerate import init_empty_weights

        from gemini.hf import GeminiTrainer
    except ImportError:
        print("transformers/accelerate are not installed: skipping this example (pip install 'gemini-offload[hf]')")
        return 0
    transformers.logging.set_verbosity_error()

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        weights = args.weights
        if weights is None:  # a stand-in for a downloaded checkpoint
            torch.manual_seed(0)
            config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                              intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                                              num_attention_heads=4, num_key_value_heads=4,
                                              max_position_embeddings=args.seq)
            transformers.LlamaForCausalLM(config).save_pretrained(out / "base")
            weights = out / "base"
        config = transformers.AutoConfig.from_pretrained(weights)
        with init_empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(config)  # parameters on meta: no memory
        training = transformers.TrainingArguments(
            output_dir=str(out / "run"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
            max_steps=args.steps, learning_rate=1e-3, weight_decay=0.01, warmup_steps=2, max_grad_norm=1.0,
            logging_steps=1, save_strategy="no", report_to="none", use_cpu=args.device == "cpu", disable_tqdm=True)
        trainer = GeminiTrainer(
            model=model, args=training, weights=weights, train_dataset=_Tokens(4 * args.steps, args.seq, config.vocab_size),
            gemini_config=gemini.GeminiConfig(device=args.device, placement="auto", device_memory=args.budget))
        trainer.train()
        main_process = trainer.is_world_process_zero()  # under torchrun: rank 0 prints and reloads
        for log in trainer.state.log_history if main_process else ():
            if "loss" in log:
                print(f"step {log['step']}: loss {log['loss']:.4f} grad_norm {log['grad_norm']:.3f} "
                      f"lr {log['learning_rate']:.2e} device peak {log['gemini_device_peak_mib']:.1f} MiB")
        trainer.save_model(out / "final")  # every rank (a collective under ZeRO); rank 0 writes
        if main_process:
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
            print(f"saved and reloaded with from_pretrained: {sum(t.numel() for t in reloaded.parameters())} "
                  f"parameters; {trainer.gemini_world_size} rank(s)")
        trainer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
