"""The release's model card (``release/README.md``), generated from the metrics files and ``config.json`` alone.

Every number in it is a value of ``metrics/summary.json``, ``metrics/groups.tsv``, ``metrics/storage.json``, the
protocols of ``metrics/{ppl,gsm8k,generation,retrieval}.json`` or the release's ``config.json``, formatted, never
computed (``tests/test_release.py`` regenerates the card and traces each number back).  The front matter is the
hub's model-card YAML (license, base_model, tags, datasets, library_name).
"""

from __future__ import annotations

import csv
import io
from typing import Mapping

import yaml

from ..groups import GROUPS

QWEN = "qwen3_5_4b"
MODE_A_READS = "mode_a/"  # Mode A's row: its own folder of the release (bank, adapters, sink)


def reads(group: str) -> str:
    """The maps a headline row reads from the release, from the group's flags (``–``: none)."""
    if group == "mode_a":
        return MODE_A_READS
    spec = GROUPS.get(group)
    maps = [] if spec is None else [m for m, used in (("projector", spec.projected_source),
                                                      ("adapters", spec.adapters)) if used]
    return " + ".join(maps) or "–"


BASIS = "decoder_attention"  # the groups' KV bytes per token: bf16, the attention layers above the split


def read_groups_tsv(text: str) -> dict[str, dict[str, float | str]]:
    """``metrics/groups.tsv`` as ``{group: {column: value}}`` (numbers as floats, empty cells left out)."""
    rows = {}
    for row in csv.DictReader(io.StringIO(text), delimiter="\t"):
        out: dict[str, float | str] = {}
        for k, v in row.items():
            if k == "group" or v in ("", None):
                continue
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
        rows[row["group"]] = out
    return rows


def profile(model: str) -> str:
    """How the card names the run's profile: never an embedded figure as a Qwen3.5-4B one."""
    if model == QWEN:
        return "full profile (Qwen3.5-4B)"
    if model.startswith("tiny"):
        return "tiny test profile (a random-init model): NOT a result, NOT a Qwen3.5-4B result"
    if model == "smollm2_135m":
        return "embedded default, NOT a Qwen3.5-4B result"
    return f"profile {model}, NOT a Qwen3.5-4B result"


def _ci(row: Mapping, key: str, fmt: str) -> str:
    if key not in row:
        return "–"
    value = f"{row[key]:{fmt}}"
    if f"{key}_lo" in row and f"{key}_hi" in row:
        value += f" [{row[f'{key}_lo']:{fmt}}, {row[f'{key}_hi']:{fmt}}]"
    return value


def headline_table(summary: Mapping, groups: Mapping, storage: Mapping) -> list[str]:
    """The headline with its 95% intervals (paired bootstrap; Wilson for passkey %) and bytes per token."""
    kv = storage["active_model"]["kv"]["bf16"][BASIS]
    head = ["group", "maps read", "ΔPPL % [95% CI]", "KL nats/token [95% CI]", "Δ gold NLL [95% CI]",
            "ΔPPL % worst other domain [95% CI]", "greedy agreement [95% CI]", "passkey % [95% CI]",
            "KV B/token (bf16)", "compression"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for group, s in summary.items():
        g = {**groups.get(group, {}), **s}  # the headline's own values, the intervals of groups.tsv
        worst = g.get("worst_domain")
        if worst and f"{worst}_dppl_pct_lo" in g:
            g |= {"worst_domain_dppl_pct_lo": g[f"{worst}_dppl_pct_lo"],
                  "worst_domain_dppl_pct_hi": g[f"{worst}_dppl_pct_hi"]}
        if "dppl_pct" not in g:  # the baseline: its own PPL and gold NLL
            cells = [f"PPL {g['ppl']:.3f}", "–", f"NLL {g['gold_nll']:.4f}" if "gold_nll" in g else "–", "–", "–"]
        else:
            cells = [_ci(g, "dppl_pct", "+.2f"), _ci(g, "kl", ".4f"), _ci(g, "dgold_nll", "+.4f"),
                     _ci(g, "worst_domain_dppl_pct", "+.2f") + (f" ({worst})" if worst else ""),
                     _ci(g, "gen_agreement", ".3f")]
        cells.append(_ci(g, "passkey_pct", ".0f"))
        cells += ([f"{kv[group]['bytes_per_token']:,.0f}", f"{kv[group]['compression_vs_baseline']:.3f}×"]
                  if group in kv else ["–", "–"])
        lines.append(f"| {group} | {reads(group)} | " + " | ".join(cells) + " |")
    return lines


def files_table(config: Mapping, manifest: Mapping) -> list[str]:
    lines = ["| file | kind | layers | bytes |", "|---|---|---|---:|"]
    for name, f in config["files"].items():
        lines.append(f"| `{name}` | {f['kind']} ({f['role']['branch']}) | {', '.join(str(x) for x in f['layers'])} "
                     f"| {manifest['files'][name]['bytes']:,} |")
    return lines


def front_matter(config: Mapping) -> str:
    base = config["base_model"]
    matter = {"license": "apache-2.0", "library_name": "ced_csa2",
              "tags": ["kv-cache", "kv-cache-compression", "cross-layer-kv-sharing", "ced", "csa2", "safetensors"],
              "datasets": config["datasets"], "pipeline_tag": "text-generation"}
    if base["hf_id"]:
        matter["base_model"] = base["hf_id"]
    return "---\n" + yaml.safe_dump(matter, sort_keys=False, allow_unicode=True) + "---\n"


def usage(config: Mapping) -> list[str]:
    return ["```python",
            "from ced_csa2.ced_runtime import CEDModeARuntime, CEDModeBRuntime",
            "from ced_csa2.model_utils import geometry, load_model_and_tokenizer",
            "from ced_csa2.release import base_model_config, load_release, load_release_mode_a, release_plan",
            "",
            'folder = "release"  # or huggingface_hub.snapshot_download("<user>/<repo>", revision="<commit>")',
            "model, tok = load_model_and_tokenizer(base_model_config(folder))  # the very weights the maps were trained on",
            "plan = release_plan(folder)",
            "parts = load_release(folder, model)  # refuses a changed file, another base model or plan, in one line",
            'with CEDModeBRuntime(model, plan, "ced_csa2", parts, kv_format=None):',
            '    out = model.generate(**tok("The capital of France is", return_tensors="pt"), max_new_tokens=20)',
            *(["parts_a, settings = load_release_mode_a(folder, model)  # Mode A: the prefill skip",
               "runtime = CEDModeARuntime(model, plan, geometry(model.config), parts_a, **settings)",
               'cache = runtime.prefill(tok("The capital of France is", return_tensors="pt").input_ids)']
              if "mode_a" in config["maps"] else []),
            "```"]


def model_card(config: Mapping, manifest: Mapping, metrics: Mapping) -> str:
    """``release/README.md`` from ``config.json``, ``manifest.json`` and the metrics (see the module doc).

    ``metrics``: ``summary`` (summary.json), ``groups`` (:func:`read_groups_tsv`), ``storage``, and the
    ``protocol`` of ``ppl``, ``gsm8k``, ``generation``, ``retrieval`` (each a dict, ``{}`` where absent), ``domains``
    (the other domains' names).
    """
    summary, groups, storage = metrics["summary"], metrics["groups"], metrics["storage"]
    p, g = metrics["ppl"], metrics["gsm8k"]
    gen, ret = metrics.get("generation") or {}, metrics.get("retrieval") or {}
    base, plan = config["base_model"], config["plan"]
    name = base["hf_id"] or base["name"]
    weights = (f"`{base['weights_file']}` (sha256 `{base['weights_sha256']}`)" if base["weights_sha256"]
               else f"revision `{base['revision'] or 'unpinned'}`")
    out = [front_matter(config),
           f"# CED + CSA2 maps for {name} ({profile(p['model'])})", "",
           f"Trained maps that retrofit KV-cache compression onto **{name}** (weights {weights}), written by the "
           "`release` stage of the ced-csa2 pipeline (`dvc repro`). **CED** (compute): a linear projector maps the "
           f"hidden state after layer {plan['split']} to layer {plan['source']}'s K/V. **CSA2** (storage): layers "
           f"{', '.join(str(t) for t in plan['targets'])} read the one stored K/V of layer {plan['source']} through "
           "adapters (ridge-initialised linear map + residual MLP per target, K and V). **Mode A** (prefill skip): "
           f"the prompt runs through layers 1..{plan['split']} only; every attention layer above the cut gets its "
           "prompt K/V from the maps in `mode_a/`, the first position from constant sink K/V. The maps fit these "
           "weights only: `load_release` refuses a model whose weights' fingerprint is not `config.json`'s (load it "
           "with `base_model_config`, which names the very file).", "",
           "## Files", "",
           *files_table(config, manifest), "",
           f"Stored in **{config['dtype']['stored']}**: {config['dtype']['why']} Each header holds the role, plan, "
           "layers, widths, dtype, base model (id, revision, weights sha256, fingerprint) and the params as applied; "
           "`config.json` lists them all; `manifest.json` holds every file's sha256.", "",
           "## Protocol", "",
           f"Profile: **{profile(p['model'])}**. Model `{p['model']}` in {p['dtype']} on {p['device']}. ΔPPL and KL: "
           f"{p['records']} held-out records of `{p['data']}` (domain `{p['domain']}`, {p['tokens_scored']:,} scored "
           f"tokens, teacher-forced); Δ gold NLL: {g.get('label', g.get('math_set'))} gold solutions (n = {g['n']}, "
           f"{g['num_fewshot']}-shot); worst other domain: ΔPPL on the worst of "
           f"{', '.join(metrics['domains']) or 'no other domain'} (records the maps never saw)"
           + (f"; greedy agreement: {gen['prompts']} held-out prompts of {gen['prompt_tokens']} tokens, "
              f"{gen['new_tokens']} new tokens through each group's own cache" if gen else "")
           + (f"; passkey: {ret['records']} records of {ret['length']:,} tokens" if ret else "")
           + ". Intervals: paired bootstrap 95% over records or prompts, Wilson 95% for passkey %. KV bytes per "
           f"token: bf16, on the `{BASIS}` basis (the attention layers above the split; "
           "`metrics/storage.json` has every basis).", "",
           "## Results", "",
           *headline_table(summary, groups, storage), "",
           "`maps read`: what each group loads from this release (the FP4 groups also store K/V in "
           f"{storage.get('kv_format', 'FP4')}; baseline, FP4-only, `share_plain` and `xkv` rows read none and are "
           "context). Mode A's ΔPPL and KL are against the plain prefill, on each record's second half.", "",
           "## Usage", "",
           "`pip install` the ced-csa2 package (this repository), then:", "",
           *usage(config), "",
           "## Limits", ""]
    out += limits(summary)
    out += ["", "## Publishing", "",
            "Not run by the pipeline or its tests; after `huggingface-cli login`:", "",
            "```python",
            "from huggingface_hub import upload_folder",
            'upload_folder(folder_path="release", repo_id="<user>/<repo>", repo_type="model")',
            "```", ""]
    return "\n".join(out)


def limits(summary: Mapping) -> list[str]:
    """The limits the headline shows: transfer to other domains, and Mode A when it generates."""
    lines = []
    base = summary.get("baseline", {})
    costs = [f"`{group}` {s['dppl_pct']:+.2f}% → {s['worst_domain_dppl_pct']:+.2f}%" for group, s in
             ((g, summary.get(g)) for g in ("ced", "csa2", "ced_csa2")) if s and "worst_domain_dppl_pct" in s]
    if costs:
        lines.append("- **Transfer to other domains**: the maps are fitted to their training domain and cost more on "
                     "text unlike it (ΔPPL in domain → on the worst other domain): " + ", ".join(costs) + ".")
    a = summary.get("mode_a")
    if a:
        line = (f"- **Mode A generating**: teacher-forced it costs {a['dppl_pct']:+.2f}% ΔPPL, but through its own "
                "cache")
        if "passkey_pct" in a:
            line += (f" it retrieves {a['passkey_pct']:.0f}% of the passkeys (baseline "
                     f"{base.get('passkey_pct', float('nan')):.0f}%)")
        if "gen_agreement" in a:
            line += f" and keeps {a['gen_agreement']:.3f} of the baseline's greedy tokens"
        lines.append(line + ": do not serve generation or retrieval through Mode A on these maps.")
    lines.append("- The figures are this run's model, data and dtype only (see Protocol); they say nothing about "
                 "another base model, which needs maps trained for it.")
    return lines
