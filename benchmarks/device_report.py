"""The device check's Markdown report (``benchmarks.device_check``): one table per part, from its JSON."""

from __future__ import annotations

from typing import Any

__all__ = ["markdown", "last_line"]


def last_line(text: str | None) -> str:
    """A message's last non-empty line (an error's own words, after its traceback)."""
    return text.strip().splitlines()[-1] if text and text.strip() else ""


def cell(value: Any, digits: int = 2) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(report: dict) -> str:
    parts = report["parts"]
    env = parts.get("environment", {}).get("result", {})
    rows = [["device", f"{cell(env.get('device_name'))} ({report['device']})"],
            ["torch", f"{cell(env.get('torch'))}, CUDA {cell(env.get('cuda'))}, cuDNN {cell(env.get('cudnn'))}, "
                      f"Triton {cell(env.get('triton'))}"]]
    rows += [[key, cell(env[key])] for key in ("gpu_memory_gib", "multiprocessors", "capability", "driver", "tf32",
                                               "cpu", "python", "platform", "nvchat_torch", "git_commit", "mlx")
             if env.get(key) is not None]
    rows += [["command", f"`{report['command']}`"], ["started", report["started"]],
             ["budget", f"{report['budget_seconds']:.0f} s, used {cell(report.get('wall_s'), 1)} s"]]
    lines = ["# Device check", ""] + table(["", ""], rows) + [""]
    lines += table(["part", "status", "seconds", "note"],
                   [[name, p["status"], cell(p.get("seconds"), 1), cell(last_line(p.get("error") or p.get("reason")))]
                    for name, p in parts.items()])
    for render, name in ((markdown_doctor, "doctor"), (markdown_parity, "parity"), (markdown_deep, "deep"),
                         (markdown_full, "full"), (markdown_prompt, "prompt")):
        result = parts.get(name, {}).get("result")
        lines += render(result) if result else []
    return "\n".join(lines) + "\n"


def markdown_doctor(r: dict) -> list[str]:
    lines = ["", "## Doctor", "",
             f"- kernels (non-view ATen ops) per frame: {cell(r.get('kernels_per_frame'), 0)}; host reads per frame: "
             f"{cell(r.get('host_reads_per_frame'), 0)}; wall time per frame {cell(r.get('wall_ms_per_frame'))} ms, "
             f"real-time factor {cell(r.get('realtime_factor'), 3)}",
             f"- fell back: {cell('; '.join(r.get('fell_back') or []) or 'nothing')}",
             f"- failing self-tests: {cell('; '.join(r.get('self_tests_failing') or []) or 'none')}"]
    if r.get("report"):
        lines += ["", "<details><summary>the doctor's report</summary>", "", r["report"], "", "</details>"]
    return lines


def markdown_parity(r: dict) -> list[str]:
    rows = []
    for m in r.get("models", []):
        for v in m["variants"]:
            c = v.get("comparison")
            if c is None:
                rows.append([m["preset"], cell(v["variant"]), cell(v.get("skipped") or last_line(v.get("error")))]
                            + ["-"] * 6 + [cell(v.get("seconds"), 1)])
                continue
            agree = c["agree"]
            audio = "-" if c["max_audio_diff"] is None else format(c["max_audio_diff"], ".3g")
            rows.append([m["preset"], cell(v["variant"]), str(c["compared"]), str(agree["text ids"]),
                         str(agree["function ids"]), str(agree["transcript"]), str(agree["codes"]),
                         f"{cell(c['first_divergent_frame'])} {', '.join(c.get('differs_in', []))}".strip(), audio,
                         cell(v.get("seconds"), 1)])
    return ["", "## Parity against the CPU", "",
            f"Reference: {r.get('reference')}; {r.get('mode')}; {r.get('frames')} frames; layout: {r.get('layout')}. "
            f"Verdict: **{'OK' if r.get('ok') else 'NOT OK'}**.", ""] + table(
        ["model", "variant", "frames", "text ids", "function ids", "transcript", "codes", "first divergent",
         "max audio diff", "s"], rows)


def markdown_deep(r: dict) -> list[str]:
    rows = []
    for v in r.get("variants", []):
        if "ms_per_frame" not in v:
            rows.append([cell(v["variant"]), cell(v.get("skipped") or last_line(v.get("error")))] + ["-"] * 12)
            continue
        t, k = v["ms_per_frame"], v.get("kernels", {})
        rows.append([v["variant"], cell(v["first_frame_s"])] + [cell(t[key]) for key in ("median", "mean", "p95")]
                    + [cell(v["realtime_factor"], 3)]
                    + [cell(k.get(key)) for key in ("cuda_kernels", "cuda_copies", "launch_calls", "graph_launches",
                                                    "profiler_ops", "dispatched_ops")]
                    + [cell(v.get("host_reads")), cell(v.get("peak_memory_mib"), 0)])
    return ["", "## Deep preset: frame time and kernels per frame", "",
            f"{r.get('mode')}; layout: {r.get('layout')}. {r.get('kernel_counting')}.", ""] + table(
        ["variant", "first frame s", "median ms", "mean ms", "p95 ms", "RTF", "cuda kernels", "copies", "launch calls",
         "graph launches", "profiler ops", "dispatched ops", "host reads", "peak MiB"], rows)


def markdown_full(r: dict) -> list[str]:
    figures = [[label, f"{cell(r.get(key), digits)} {unit}"] for label, key, digits, unit in (
        ("build + prepare", "build_s", 1, "s"), ("weights as held", "weights_gb", 3, "GB"),
        ("memory after the build", "memory_after_build_mib", 0, "MiB"), ("host peak RSS", "host_peak_rss_mib", 0, "MiB"),
        ("peak memory (build and every step)", "peak_memory_mib", 0, "MiB"))]
    rows = [[str(row["sessions"]), cell(row["step_ms"]["median"]), cell(row["step_ms"]["p95"]),
             cell(row["realtime_factor"], 3), cell(row["frames_per_second"], 1),
             cell(row.get("kernels", {}).get("cuda_kernels"))] for row in r.get("engine", [])]
    return (["", "## Full-size 4-bit model", "", f"{r.get('model')}; mode: {r.get('mode')}.", ""]
            + table(["", ""], figures) + [""]
            + table(["sessions", "median step ms", "p95 ms", "real-time factor (step / 80 ms)", "frames/s",
                     "cuda kernels per step"], rows))


def markdown_prompt(r: dict) -> list[str]:
    rows = []
    for model in ("deep", "full"):
        timings = r.get(model) or {}
        if "prompts" not in timings:
            why = timings.get("skipped") or last_line(timings.get("error")) or "not measured"
            rows.append([model, cell(why)] + ["-"] * 5)
        for p in timings.get("prompts", []):
            rows.append([timings["model"], p["prompt"], str(p["characters"]), str(p["positions"]), cell(p["seconds"], 3),
                         cell(timings["frame_ms"]), cell(p["frames"], 1)])
    pieces = [f"{timings['model']}: " + ", ".join(f"{piece} {ms} ms" for piece, ms in timings["llm_ms_per_position"].items())
              for timings in (r.get("deep") or {}, r.get("full") or {}) if timings.get("llm_ms_per_position")]
    return ["", "## Unseen prompt: opening a session until it is ready", "", cell(r.get("note")), ""] + table(
        ["model", "prompt", "characters", "positions", "seconds", "frame ms", "frames"], rows) + (
        ["", "The LLM's pass over the first prompt, per position, by piece: " + "; ".join(pieces)] if pieces else [])
