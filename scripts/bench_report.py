"""The Markdown tables of a scripts/benchmark.py report (main table, kernels used, compiled
decode, peers and llama.cpp), and the number formatting they share."""
from __future__ import annotations

import bench_llama_cpp  # beside this script


def fmt(v, spec: str = ".2f", none: str = "–") -> str:
    if v is None:
        return none
    if isinstance(v, float) and v == float("inf"):
        return "inf"
    return format(v, spec)


def ratio(x, y):
    return None if x is None or y is None or y == 0 else x / y


def compiled_keys(results: dict) -> list[tuple[str, str]]:
    """(eager key, compiled key) of each decode measured compiled: (decode_tps, compiled_decode_tps),
    (decode_tps_b4, compiled_decode_tps_b4), ..."""
    keys = {k for r in results.values() for k in r if k.startswith("compiled_decode_tps") and not k.endswith("_runs")}
    return sorted(((k.removeprefix("compiled_"), k) for k in keys), key=lambda kv: (len(kv[0]), kv[0]))


def compiled_markdown(rows: dict) -> list[str]:
    """The compiled rows: each config's decode eager and compiled, ratios to eager bf16."""
    pairs = compiled_keys(rows)
    if not pairs:
        return []
    base = rows.get("bf16", {})
    batch = lambda k: "b1" if k == "decode_tps" else k.removeprefix("decode_tps_")  # noqa: E731
    head = "| config |" + "".join(f" {batch(e)} eager tok/s | ×bf16 | {batch(e)} compiled tok/s | ×bf16 eager | "
                                  f"compiled/eager |" for e, _ in pairs) + " compile s (b1) | kernels in a compiled step |"
    lines = ["", "Compiled decode: static KV cache, the step under torch.compile (fullgraph, static shapes); "
             "ratios to eager bf16 (its decode tok/s columns above); compiled/eager: against eager runs alternated with the "
             "compiled ones; compile s: the first compiled step, compilation included.", "",
             head, "|" + " --- |" * (head.count("|") - 1)]
    for name, r in rows.items():
        if not any(c in r for _, c in pairs):
            continue
        cells = [name]
        for e, c in pairs:
            side_by_side = r.get("compiled_eager_" + e, r.get(e))
            cells += [fmt(r.get(e)), fmt(ratio(r.get(e), base.get(e))), fmt(r.get(c)), fmt(ratio(r.get(c), base.get(e))),
                      fmt(ratio(r.get(c), side_by_side))]
        cells += [fmt(r.get("compile_s"), ".1f"), "; ".join(r.get("kernels_decode_compiled") or []) or "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(report: dict) -> str:
    rows = report["results"]
    base = rows.get("bf16", {})
    extra = sorted({int(k[len("decode_tps_b"):]) for r in rows.values() for k in r if k.startswith("decode_tps_b")})
    head = ("| config | load s | load peak RSS MB | peak RSS MB | model MB | size ×bf16 | decode tok/s | ×bf16 | decode limit tok/s "
            "| % of limit |" + "".join(f" decode b{b} tok/s | ×bf16 |" for b in extra) +
            " prefill s | ×bf16 | save MB | reload s | reload peak RSS MB | SQNR dB | top-1 |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for name, r in rows.items():
        if r.get("error") and "decode_tps" not in r:
            lines.append(f"| {name} | {r['error']} |" + " |" * (head.count("|") - 3))
            continue
        mb = r.get("model_bytes")
        lines.append("| " + " | ".join([
            name, fmt(r.get("load_s"), ".1f"), fmt(r.get("load_peak_rss_mb"), ".0f"), fmt(r.get("peak_rss_mb"), ".0f"),
            fmt(mb / 1e6 if mb else None, ".1f"), fmt(ratio(mb, base.get("model_bytes")), ".2f"),
            fmt(r.get("decode_tps"), ".2f"), fmt(ratio(r.get("decode_tps"), base.get("decode_tps")), ".2f"),
            fmt(r.get("decode_limit_tps"), ".1f"),
            fmt(None if ratio(r.get("decode_tps"), r.get("decode_limit_tps")) is None
                else 100 * ratio(r.get("decode_tps"), r.get("decode_limit_tps")), ".0f"),
            *[v for b in extra for v in (fmt(r.get(f"decode_tps_b{b}"), ".2f"),
                                         fmt(ratio(r.get(f"decode_tps_b{b}"), base.get(f"decode_tps_b{b}")), ".2f"))],
            fmt(r.get("prefill_s"), ".2f"),
            fmt(ratio(r.get("prefill_s"), base.get("prefill_s")), ".2f"),
            fmt(r["save_bytes"] / 1e6 if r.get("save_bytes") else None, ".1f"), fmt(r.get("reload_s"), ".1f"),
            fmt(r.get("reload_peak_rss_mb"), ".0f"), fmt(r.get("sqnr_db"), ".1f"), fmt(r.get("top1_agree"), ".3f"),
        ]) + " |")
    used = {name: r for name, r in rows.items() if r.get("kernels_prefill") or r.get("kernels_decode")}
    if used:
        lines += ["", "| config | kernels in prefill (calls) | kernels in a batch-1 decode step (calls) |", "| --- | --- | --- |"]
        for name, r in used.items():
            lines.append(f"| {name} | {'; '.join(r.get('kernels_prefill') or [])} | {'; '.join(r.get('kernels_decode') or [])} |")
    lines += compiled_markdown(rows)
    peers = report.get("vs_peers") or {}
    if peers:
        lines += ["", "| hf_aoq vs peer | decode tok/s ratio | prefill s ratio | model bytes ratio |", "| --- | --- | --- | --- |"]
        for key, v in peers.items():
            lines.append(f"| {key} | {fmt(v.get('decode_tps'))} | {fmt(v.get('prefill_s'))} | {fmt(v.get('model_bytes'))} |")
    return "\n".join(lines + bench_llama_cpp.markdown(report, fmt))
