"""A check, run by hand: NeMo's own label functions and EAR-TTS loss against :mod:`nvchat_torch.training.labels`
and :mod:`nvchat_torch.training` on random inputs.

    python -m benchmarks.nemo_labels --nemo /path/to/NeMo [--trials 3000]

``--nemo``: a checkout of NVIDIA's NeMo at branch ``nemotron-labs-voicechat`` (e.g. the ``ishine/NeMo``
mirror). NeMo does not install for a CPU test run (lhotse, hydra, Megatron), so the functions are read from
its source files and run with stand-ins for what they import (logging, lhotse's ``compute_num_frames`` as
lhotse documents it, the tokenizer, a ``self`` for the model's methods); nothing of NeMo is copied here.
Results: docs/training.md ("Labels", "The objectives").
"""

from __future__ import annotations

import argparse
import ast
import random
import sys
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import torch

from nvchat_torch.training import labels as tl

P, B, E, START, END, RESULT_END = 0, 1, 2, 90, 91, 92


class _Log:
    def info(self, *args: Any, **kwargs: Any) -> None:
        pass

    warning = error = info


class _Cfg(dict):
    def get(self, key: str, default: Any = None) -> Any:
        return dict.get(self, key, default)

    def __getattr__(self, key: str) -> Any:
        return self[key]


def nemo_functions(path: Path, names: set[str], env: dict[str, Any]) -> dict[str, Any]:
    """The top-level or method definitions ``names`` of a NeMo source file, compiled against ``env``."""
    scope = {"torch": torch, "Cut": object, "TokenizerSpec": object, "Seconds": float, "logging": _Log(), **env}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), scope)
    missing = names - set(scope)
    if missing:
        raise SystemExit(f"{path}: no function {sorted(missing)}")
    return scope


def check_shifts(root: Path, rng: random.Random, trials: int) -> None:
    lp = nemo_functions(root / "parts/label_prep.py", {"delay_eos", "prepare_labels"}, {})
    for _ in range(trials):
        t = rng.randint(3, 20)
        ch = [rng.choice([P, P, P, B, E, 5, 6, 7]) for _ in range(t)]
        adv, dl, de, db = rng.choice([0, 0, 1, 2]), rng.choice([0, 0, 1, 3]), rng.choice([0, 0, 2]), rng.choice([0, 0, 1])
        cfg = _Cfg(delay_text_channel_by=dl, delay_text_eos_by=de, delay_text_bos_by=db)
        out = lp["prepare_labels"]({}, torch.tensor([ch]), torch.zeros(1, t, 4), cfg, False, 90, 91, P, B, E,
                                   advance_text_channel_by=adv)
        nemo = torch.cat([out["text_inputs"][0, :1], out["text_labels"][0]]).tolist()
        mine = tl.shift_channel(ch, pad=P, eos=E, bos=B, advance=adv, delay=dl, delay_eos_by=de, delay_bos_by=db)
        assert nemo == mine, (ch, adv, dl, de, db, nemo, mine)
    print(f"prepare_labels' shifts and delay_eos: equal on {trials} random channels")


def check_function_channel(root: Path, rng: random.Random, trials: int) -> None:
    stt = nemo_functions(root / "models/duplex_stt_model.py",
                         {"_build_function_calling_channel", "_expand_channels_with_insertions"}, {})
    me = NS(cfg=_Cfg(), text_pad_id=P, _get_function_call_special_tokens=lambda: (START, END, RESULT_END),
            _get_silence_embeddings=lambda length, factor: torch.full((length, 1), -1.0), tokenizer=None)

    def rows(lists: list[list[int]]) -> torch.Tensor:
        return torch.tensor([r + [0] * (5 - len(r)) for r in lists])

    for _ in range(trials):
        frames = rng.randint(4, 30)
        calls = []
        for _ in range(rng.randint(1, 3)):
            at = rng.randint(0, frames - 1)
            result_at = rng.choice([-1, rng.randint(at, frames - 1)])
            calls.append((at, [rng.randint(10, 20) for _ in range(rng.randint(1, 4))], result_at,
                          [rng.randint(30, 40) for _ in range(rng.randint(0, 3))] if result_at >= 0 else []))
        batch = {"target_tokens": torch.zeros(1, frames, dtype=torch.long),
                 "function_calls": rows([c[1] for c in calls])[None],
                 "function_call_lengths": torch.tensor([[len(c[1]) for c in calls]]),
                 "function_call_steps": torch.tensor([[c[0] for c in calls]]),
                 "function_responses": rows([c[3] for c in calls])[None],
                 "function_response_lengths": torch.tensor([[len(c[3]) if c[2] >= 0 else -1 for c in calls]]),
                 "function_response_steps": torch.tensor([[c[2] for c in calls]])}
        ids, mask, insertions = stt["_build_function_calling_channel"](me, batch, frames)
        mine = tl.function_channel(calls, frames, pad=P, start=START, end=END, result_end=RESULT_END)
        assert (ids[0].tolist(), mask[0].tolist(), insertions[0]) == (mine.ids, mine.loss_mask, mine.insertions), calls
        text = torch.arange(100, 100 + frames)[None]
        grown, _, _ = stt["_expand_channels_with_insertions"](me, text, torch.zeros(1, frames, 1), insertions, 8.0)
        assert grown[0].tolist() == tl.insert_frames(text[0].tolist(), mine.insertions, P)
    print(f"_build_function_calling_channel and _expand_channels_with_insertions: equal on {trials} random calls")


def check_agent_channels(root: Path, rng: random.Random, trials: int) -> None:
    texts: dict[str, list[int]] = {}
    frames_of = {"compute_num_frames": lambda t, frame, rate: tl.num_frames(t, frame, rate)}
    s2s = nemo_functions(root / "data/s2s_dataset.py", {"build_token_channel"},
                         {**frames_of, "normalize_text": lambda text, **kw: text,
                          "_text_to_ids": lambda text, tok, pad, **kw: list(texts[text])})
    tts = nemo_functions(root / "data/duplex_ear_tts_dataset.py", {"build_token_channel"}, frames_of)
    tok = NS(bos=B, eos=E, text_to_ids=lambda text: list(texts[text]))
    for trial in range(trials):
        duration = rng.uniform(0.2, 3.0)
        sups, turns = [], []
        for i in range(rng.randint(0, 3)):
            start = rng.uniform(0, duration + 0.3)
            end = start + rng.uniform(-0.1, 1.5)
            texts[f"{trial}.{i}"] = ids = [rng.randint(10, 50) for _ in range(rng.randint(0, 12))]
            sups.append(NS(speaker="agent", start=start, end=end, text=f"{trial}.{i}", custom=None))
            turns.append((start, end, ids))
        for rate in (16000, 22050):
            cut = NS(id="c", duration=duration, sampling_rate=rate, supervisions=sups)
            frames = tl.num_frames(duration, rate=rate)
            if rate == 16000:
                nemo = s2s["build_token_channel"](cut, tok, P, 0.08, {"agent"}, bos_id=B, eos_id=E,
                                                  remove_timestamps=True)
                assert nemo.tolist() == tl.agent_channel(turns, frames, bos=B, eos=E, pad=P), (turns, duration)
            nemo = tts["build_token_channel"](cut, tok, 0.08, {"agent"}, pad_id=P)
            assert nemo.tolist() == tl.agent_channel(turns, frames, bos=B, eos=E, pad=P, tts=True, rate=rate)
    print(f"build_token_channel (the STT and the TTS data's): equal on {trials} random conversations")


def check_tts_loss(root: Path, rng: random.Random, trials: int) -> None:
    """``RVQEARTTSModel._compute_losses`` with its ``depthsum_embedding`` and ``MoGHead.dist`` against
    :func:`~nvchat_torch.training.tts_loss` on the tiny model's codebooks and random head outputs."""
    import contextlib
    import math

    import torch.nn.functional as F

    from nvchat_torch.tiny import random_model
    from nvchat_torch.training.objectives import TTSLossConfig, TTSOutput, tts_loss

    ear = nemo_functions(root / "modules/ear_tts_model.py", {"_compute_losses", "depthsum_embedding", "dist"},
                         {"F": F, "math": math, "Tensor": torch.Tensor, "fp32_precision": contextlib.nullcontext})
    model = random_model("tiny", seed=2)
    tts = model.tts_model.tts_model
    head, cfg = tts.mog_head, tts.config
    nemo_head = NS(low_rank=head.low_rank, low_mat=head.low_mat.detach(), num_predictions=head.num_predictions)
    nemo_head.dist = lambda mus, mu: ear["dist"](nemo_head, mus, mu)
    me = NS(rvq_embs=tts.rvq_embs.detach(), mog_head=nemo_head,
            config=_Cfg(disable_eos_prediction=True, latent_size=cfg.latent_size, codebook_size=cfg.codebook_size,
                        label_smoothing=0.01))
    me.depthsum_embedding = lambda code: ear["depthsum_embedding"](me, code)
    g = torch.Generator().manual_seed(rng.randint(0, 1 << 30))
    q, k, r, d = cfg.num_quantizers, head.num_predictions, head.low_rank, cfg.latent_size
    for _ in range(max(1, trials // 100)):
        b, s = 2, 5
        out = TTSOutput(torch.randn(b, s, k, generator=g), torch.randn(b, s, k, r, generator=g),
                        torch.randn(b, s, d, generator=g), torch.randn(b, s, 1, generator=g).clamp(min=-4),
                        torch.arange(q) < torch.randint(0, q + 1, (b, s, 1), generator=g),
                        torch.ones(b, s, q, dtype=torch.bool))
        codes = torch.randint(0, cfg.codebook_size, (b, s, q), generator=g)
        steps = torch.rand(b, s, generator=g) < 0.8
        _, c_loss, k_loss = ear["_compute_losses"](me, codes, None, out.logits, out.mus, out.mu_res, out.log_std,
                                                   out.src_mask, out.tgt_mask, steps)
        mine = tts_loss(model, out, codes, steps, TTSLossConfig(label_smoothing=0.01))
        torch.testing.assert_close(mine["c_loss"], c_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine["k_loss"], k_loss, rtol=1e-5, atol=1e-6)
    print(f"_compute_losses (c_loss, k_loss): equal on {max(1, trials // 100)} random batches")
    # prepare_training_inputs draws from the global generator in the order quantizer_masks draws from its own
    prep = nemo_functions(root / "modules/ear_tts_model.py",
                          {"prepare_training_inputs", "get_mask", "sequence_mask", "get_masking_rate"}, {"Tensor": torch.Tensor})
    conf = TTSLossConfig()
    me.config = _Cfg(max_training_rate=conf.max_training_rate, exponent=conf.exponent, num_quantizers=q,
                     codebook_size=cfg.codebook_size, random_target_masking=False,
                     quantizer_dropout=conf.quantizer_dropout)
    from nvchat_torch.training.objectives import quantizer_masks
    for seed in range(max(1, trials // 100)):
        codes = torch.randint(0, cfg.codebook_size, (3, 40, q), generator=g)
        torch.manual_seed(seed)
        _, src, _, _, dropped = prep["prepare_training_inputs"](me, codes)
        torch.manual_seed(seed)
        mine_src, keep = quantizer_masks((3, 40), q, conf, None, torch.device("cpu"))
        assert torch.equal(src, mine_src) and torch.equal(dropped != cfg.codebook_size, keep)
    print(f"prepare_training_inputs (masking, quantizer dropout): the same draws on {max(1, trials // 100)} seeds")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.nemo_labels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nemo", required=True, type=Path, help="a NeMo checkout (branch nemotron-labs-voicechat)")
    p.add_argument("--trials", type=int, default=3000)
    args = p.parse_args(argv)
    root = args.nemo / "nemo/collections/speechlm2"
    rng = random.Random(0)
    check_shifts(root, rng, args.trials)
    check_function_channel(root, rng, args.trials)
    check_agent_channels(root, rng, args.trials)
    check_tts_loss(root, rng, args.trials)
    return 0


if __name__ == "__main__":
    sys.exit(main())
