"""End to end: `dvc repro` on the tiny profile in a temporary copy of the repository.

The tests share one copy (module fixtures): ``reproduced`` runs the whole pipeline once,
recording what each stage reads, for every test that inspects its outputs, so that any
test runs alone; run together, the prepare/dump test goes first, on a fresh copy.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import (AMP_OVERRIDES, E2E_OVERRIDES, ROOT, project_copy, read_curves, readme_headline_problem, sh,
                      staged_summary)

from ced_csa2.diff import parse_table
from ced_csa2.eval.results import HEADLINE
from ced_csa2.train.objective_registry import OBJECTIVES

pytestmark = pytest.mark.slow
TRAINED = [name for name, o in OBJECTIVES.items() if o.trains]  # each writes its phases and their curves


def stages_run(output: str) -> set[str]:
    return {line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage")}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """The project's files (tracked and untracked-not-ignored) in a fresh git repo, tiny profile."""
    dst = project_copy(tmp_path_factory.mktemp("repo"))
    sh(dst, "git", "config", "user.email", "ci@example.com")
    sh(dst, "git", "config", "user.name", "ci")
    sh(dst, sys.executable, "-m", "ced_csa2.compose", *E2E_OVERRIDES, *AMP_OVERRIDES)
    return dst


@pytest.fixture(scope="module")
def reads(tmp_path_factory):
    """Where the full run records, per stage, the params keys and artifact files it read."""
    return tmp_path_factory.mktemp("reads")


@pytest.fixture(scope="module")
def reproduced(repo, reads) -> str:
    """The output of a full ``dvc repro`` of ``repo`` (each stage's reads recorded in ``reads``)."""
    return sh(repo, "dvc", "repro", CED_CSA2_RECORD_READS=str(reads))


def test_repro_prepare_dump_then_nothing_to_do(repo, reads):
    sh(repo, "dvc", "repro", "prepare", "dump", CED_CSA2_RECORD_READS=str(reads))
    metrics = json.loads((repo / "metrics/dump.json").read_text())
    train = (repo / "data/corpus/train.jsonl").read_text().splitlines()
    assert metrics["records"] == len(train) and metrics["tokens"] == 4000  # E2E_OVERRIDES' mix: its rows exactly
    assert (repo / "data/dump/dump.h5").is_file() and not list((repo / "data").glob("*.partial.*"))
    assert stages_run(sh(repo, "dvc", "repro", "prepare", "dump")) == set()


def test_full_pipeline_writes_every_metric_and_the_report(repo, reproduced):
    for name in ("prepare", "dump", "ridge", "projector", "adapters", "ppl", "gsm8k", "storage"):
        assert (repo / f"metrics/{name}.json").is_file(), name
    report = (repo / "reports/results.md").read_text()
    assert "tiny_qwen3_5" in report and "tiny-math" in report
    rows = [line.split("|")[1].strip() for line in report.splitlines() if line.startswith("| ")]
    assert {"baseline", "share_plain", "ced", "csa2", "ced_csa2"} <= set(rows)
    objective_rows = {tuple(c.strip() for c in line.split("|")[1:3]) for line in report.splitlines()
                      if line.startswith("| ")}
    for group in ("ced", "csa2", "ced_csa2"):
        assert {(group, o) for o in ("kv_mse (seed)", *OBJECTIVES)} <= objective_rows
    assert ("ced", "kv_mse, random init (seed read literally)") in objective_rows
    assert "mode_a (prefill skip, sink: mean, replay 0, maps trained through the skip (tune_mode_a))" in rows
    mode_a = json.loads((repo / "metrics/mode_a/train.json").read_text())
    assert mode_a["covered"] and mode_a["val_after"]["kl"] < mode_a["val_before"]["kl"]
    for objective in TRAINED:
        phases = json.loads((repo / f"metrics/objectives/{objective}/train.json").read_text())["phases"]
        assert set(phases) == {"ced", "csa2", "ced_csa2"} and all(p["tokens"] > 0 for p in phases.values())
    for png in ("ppl_by_group", "adapter_cosine", "bytes_vs_ppl"):
        assert (repo / f"reports/{png}.png").stat().st_size > 1000
    assert stages_run(sh(repo, "dvc", "repro")) == set()


def test_the_report_refuses_results_of_another_run(repo, reproduced, tmp_path):
    """metrics/gsm8k.json left from a bf16 run beside this run's float32 results: refused, naming both files."""
    from ced_csa2.config import load_params
    from ced_csa2.eval.results import build_report

    shutil.copytree(repo / "metrics", tmp_path / "metrics")
    params = load_params(repo / "params.yaml")
    build_report(params, tmp_path)  # as reproduced: accepted
    gsm = tmp_path / "metrics/gsm8k.json"
    stale = json.loads(gsm.read_text())
    dtype = stale["protocol"]["dtype"]
    stale["protocol"]["dtype"] = "bfloat16" if dtype != "bfloat16" else "float32"
    gsm.write_text(json.dumps(stale))
    with pytest.raises(ValueError, match=rf"gsm8k.json was measured with dtype=.*, metrics/ppl.json with "
                                         rf"dtype='{dtype}': rerun the pipeline"):
        build_report(params, tmp_path)


def test_groups_table_and_summary_are_the_detailed_results(repo, reproduced):
    params = yaml.safe_load((repo / "params.yaml").read_text())
    summary = json.loads((repo / "metrics/summary.json").read_text())
    rows = parse_table((repo / "metrics/groups.tsv").read_text(), "groups.tsv")
    ppl, gsm, storage = (json.loads((repo / f"metrics/{n}.json").read_text()) for n in ("ppl", "gsm8k", "storage"))
    kv = storage["active_model"]["kv"]["bf16"]["decoder_attention"]

    def number(row, key):
        return pytest.approx(float(row[key]), rel=1e-5)  # the TSV keeps 6 significant digits: <= 5e-6 relative

    for group in params["eval_ppl"]["groups"]:
        r, p = rows[group], ppl["groups"][group]
        assert number(r, "ppl") == p["ppl"]
        if group != "baseline":
            assert [number(r, k) for k in ("dppl_pct", "dppl_pct_lo", "dppl_pct_hi")] == [p["delta_pct"],
                                                                                       *p["delta_pct_ci95"]]
            assert summary[group]["dppl_pct"] == p["delta_pct"] and summary[group]["kl"] == p["kl"]
        assert (number(r, "kv_bytes"), number(r, "kv_compression")) == (kv[group]["bytes_per_token"],
                                                                        kv[group]["compression_vs_baseline"])
        g = gsm["groups"].get(group)
        if group in params["eval_gsm8k"]["groups"]:
            assert number(r, "gold_nll") == g["gold_nll"]["nll_per_token"]
            if group != "baseline":
                assert summary[group]["dgold_nll"] == g["gold_nll"]["delta"]
        else:
            assert g is None and r["gold_nll"] == "" and "dgold_nll" not in summary[group]
        if group in params["eval_gsm8k"]["generate"]:
            assert number(r, "em_flex") == 100 * g["flexible-extract"]["exact_match"]
        else:
            assert r["em_flex"] == ""
    domains = [d["name"] for d in params["data"]["domains"]]
    assert domains and list(ppl["domains"]) == domains
    for domain in domains:  # every group and Mode A on every other domain, into groups.tsv
        scored = ppl["domains"][domain]
        assert set(scored["groups"]) == set(params["eval_ppl"]["groups"]) and scored["mode_a"]["covered"]
        assert number(rows["csa2"], f"{domain}_dppl_pct") == scored["groups"]["csa2"]["delta_pct"]
        assert number(rows["mode_a"], f"{domain}_dppl_pct") == scored["mode_a"]["delta_pct"]
    retrieval = json.loads((repo / "metrics/retrieval.json").read_text())  # every label through its cache
    assert set(retrieval["groups"]) == {*params["eval_ppl"]["groups"], "mode_a"} - set(retrieval["protocol"]["not_run"])
    for label, r in retrieval["groups"].items():
        assert summary[label]["passkey_pct"] == r["accuracy_pct"] and r["n"] == params["eval_retrieval"]["records"]
        if label != "baseline":
            assert number(rows[label], "dpasskey_points") == r["delta_points"]
    assert summary["csa2"]["worst_domain_dppl_pct"] == max(ppl["domains"][d]["groups"]["csa2"]["delta_pct"]
                                                           for d in domains)
    for objective in params["train"]["objectives"]:
        evaluated = json.loads((repo / "metrics/objectives/eval.json").read_text())["objectives"][objective]["groups"]
        for group in params["train"]["eval_groups"]:
            r = rows[f"{group}@{objective}"]
            assert (number(r, "ppl"), number(r, "gold_nll")) == (evaluated[group]["ppl"],
                                                                evaluated[group]["gold_nll"]["nll_per_token"])
    # the DVC metrics: the headline only, numbers only; every detailed file a cached out, not in git
    shown = json.loads(sh(repo, "dvc", "metrics", "show", "--json"))
    files = next(iter(shown.values()))["data"]
    assert set(files) == {"metrics/summary.json"}

    def numbers(obj):
        return sum(map(numbers, obj.values())) if isinstance(obj, dict) else int(type(obj) in (int, float))

    assert numbers(files["metrics/summary.json"]["data"]) == numbers(summary) <= len(HEADLINE) * len(summary)
    ignored = sh(repo, "git", "check-ignore", "metrics/ppl.json", "metrics/ridge.json", "reports/results.md")
    assert len(ignored.split()) == 3


def test_the_readme_order_repro_then_test_passes_whatever_the_figures(repo, reproduced, tmp_path):
    """README's two commands in README's order: `make repro` rewrites metrics/summary.json with this CPU's
    figures (here the tiny profile's: nothing like the committed ones), then `make test` checks README's
    headline -- against the committed file, so it passes whatever the run gave."""
    committed, where = staged_summary(ROOT)
    assert where == "git's index"
    clone = tmp_path / "clone"
    (clone / "metrics").mkdir(parents=True)
    shutil.copy2(ROOT / "README.md", clone / "README.md")
    (clone / "metrics/summary.json").write_text(json.dumps(committed))
    sh(clone, "git", "init", "-q")
    sh(clone, "git", "add", "README.md", "metrics/summary.json")
    sh(clone, "git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-qm", "as committed")
    assert readme_headline_problem(clone) is None
    shutil.copy2(repo / "metrics/summary.json", clone / "metrics/summary.json")  # what `make repro` wrote here
    assert sh(clone, "git", "status", "--porcelain").split() == ["M", "metrics/summary.json"]
    assert readme_headline_problem(clone) is None
    # A figure that differs in what is committed is still caught: the check reads the committed file.
    sh(clone, "git", "add", "metrics/summary.json")
    assert "README's headline is stale against metrics/summary.json in git's index" in readme_headline_problem(clone)


def test_curves_one_table_per_stage_and_plots_render(repo, reproduced):
    curves = repo / "metrics/curves"
    tables = {p.relative_to(curves).as_posix(): read_curves(p) for p in curves.rglob("*.tsv")}
    assert sorted(tables) == sorted(["train_adapters.tsv", "train_projector.tsv", "tune_mode_a.tsv",
                                     *(f"tune/{o}.tsv" for o in OBJECTIVES)])
    assert tables["tune/ridge.tsv"] == ("step", {})  # ridge trains nothing
    for objective in TRAINED:
        tuned = tables[f"tune/{objective}.tsv"][1]
        ced, csa2 = ([s for s, _ in tuned[g, "train_loss"]] for g in ("ced", "csa2"))
        assert ced[0] == 1 and csa2[0] == ced[-1] + 1  # one step counter across the two phases
    assert len(tables["train_adapters.tsv"][1]) == 3 * 2 * 3  # layer x K/V x quantity
    assert not (repo / "metrics/plots").exists() and not list((repo / "metrics/objectives").rglob("curve.csv"))

    out = sh(repo, "dvc", "plots", "show", "--json")
    shown = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert not shown.get("errors"), shown.get("errors")
    ids = set(shown["data"])
    trained = {p.relative_to(repo).as_posix() for p in curves.rglob("*.tsv")} - {"metrics/curves/tune/ridge.tsv"}
    assert trained <= ids
    for table in trained:  # one plot per stage: a row per quantity, a line per series
        (plot,) = shown["data"][table]
        assert plot["content"]["facet"]["row"]["field"] == "quantity", table
        assert plot["content"]["spec"]["encoding"]["color"]["field"] == "series", table
    assert {f"reports/{png}.png" for png in ("ppl_by_group", "adapter_cosine", "bytes_vs_ppl")} <= ids
    assert "metrics/groups.tsv" in ids
    page = sh(repo, "dvc", "plots", "show")  # the HTML page, through .dvc/plots/offline.html: no CDN
    html = (repo / "dvc_plots" / "index.html").read_text()
    assert "index.html" in page and "window.vegaEmbed" in html and "cdn.jsdelivr" not in html
    epoch_logged = [i for i in ids if "/train_" in i]
    assert epoch_logged and all(shown["data"][i][0]["content"]["spec"]["encoding"]["x"]["field"] == "epoch"
                                for i in epoch_logged)


def covers(declared: str, key: str) -> bool:
    return key == declared or key.startswith(declared + ".")


def template(stage: str) -> str:
    return stage.split("@")[0]  # tune@distill -> tune: one dvc.yaml entry for every item


def test_every_stage_declares_exactly_the_params_and_files_it_reads(repo, reads, reproduced):
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    recorded = {p.stem: json.loads(p.read_text()) for p in reads.glob("*.json")}
    assert set(recorded) == set(lock)
    unread: dict[str, set] = {}
    for stage, seen in recorded.items():
        declared = set(lock[stage].get("params", {}).get("params.yaml", {}))
        undeclared = [k for k in seen["params"] if not any(covers(d, k) for d in declared)]
        assert not undeclared, f"{stage} reads params it does not declare in dvc.yaml: {undeclared}"
        # A foreach entry declares the union of its items' reads (DVC has one params list per entry).
        unread.setdefault(template(stage), declared)
        unread[template(stage)] = unread[template(stage)] - {d for d in declared
                                                              if any(covers(d, k) for k in seen["params"])}
        paths = [d["path"] for d in lock[stage].get("deps", []) + lock[stage].get("outs", [])]
        # A stage's own resumable scratch (data/*.partial.*, outside its DVC outs) is not an input.
        stray = [f for f in seen["files"] if ".partial." not in f
                 and not any(f == p or f.startswith(p.rstrip("/") + "/") for p in paths)]
        assert not stray, f"{stage} reads files it does not declare in dvc.yaml: {stray}"
    assert not {t: u for t, u in unread.items() if u}, "declared in dvc.yaml but never read"


EDITS = {  # key -> new value (the tiny profile's params)
    "kv_format": "mxfp4", "ridge.lambda": 5.0, "plan.targets": [24, 28],
    "eval_ppl.groups": ["baseline", "csa2"], "train.online.records": 9,
}


@pytest.mark.parametrize("key", EDITS)
def test_editing_a_param_marks_exactly_the_stages_that_read_it(repo, reads, reproduced, key):
    recorded = {p.stem: json.loads(p.read_text())["params"] for p in reads.glob("*.json")}
    readers = {template(s) for s, keys in recorded.items() if any(covers(key, k) or covers(k, key) for k in keys)}
    expected = {s for s in recorded if template(s) in readers}
    path = repo / "params.yaml"
    before = path.read_text()
    params = yaml.safe_load(before)
    *parents, leaf = key.split(".")
    section = params
    for name in parents:
        section = section[name]
    assert section[leaf] != EDITS[key]
    section[leaf] = EDITS[key]
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        out = sh(repo, "dvc", "status", "--json", "dvc.yaml")  # the default target (not studies/dvc.yaml)
        marked = set(json.loads(next(line for line in out.splitlines() if line.startswith("{"))))
    finally:
        path.write_text(before)
    assert expected and marked == expected


def test_a_key_no_stage_reads_is_still_refused_by_dvc_repro(repo, reproduced):
    path = repo / "params.yaml"
    before = path.read_text()
    path.write_text(before + "ridge_lambda: 10.0\n")  # meant: ridge.lambda
    try:
        out = sh(repo, "dvc", "status", "--json", "dvc.yaml")  # the default target (not studies/dvc.yaml)
        assert set(json.loads(next(line for line in out.splitlines() if line.startswith("{")))) == {"check_params"}
        env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                   DVC_NO_ANALYTICS="1", PYTHONPATH=str(ROOT / "src"))
        proc = subprocess.run(["dvc", "repro"], cwd=repo, env=env, capture_output=True, text=True)
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
        assert proc.returncode != 0 and stages_run(proc.stdout) == {"check_params"}
        assert len(errors) == 1 and "'ridge_lambda'" in errors[0] and "Traceback" not in proc.stderr
    finally:
        path.write_text(before)


def preview(repo) -> dict[str, str]:
    """``{stage: why}`` of ``python -m ced_csa2.estimate --changed`` (its rows between header and total)."""
    rows = sh(repo, sys.executable, "-m", "ced_csa2.estimate", "--changed").strip().splitlines()[1:-1]
    return {cells[0]: cells[-1] for cells in (re.split(r"\s{2,}", row.strip()) for row in rows)}


def test_an_ablation_reruns_what_reads_it_and_its_revert_restores_from_the_run_cache(repo, reproduced):
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "tiny run")
    tracked = {p: (repo / p).read_bytes() for p in sh(repo, "git", "ls-files", "metrics", "reports").split()}
    cached = {p: (repo / p).read_bytes() for p in ("metrics/adapters.json", "metrics/ppl.json", "reports/results.md")}
    params = repo / "params.yaml"
    original = params.read_text()
    # The FP4 groups' block format, read by storage and the three scoring stages. (An edit of a
    # trainer does not do here: the tiny adapters start at the ridge optimum and move ΔPPL by ~1e-6
    # relative, which `dvc exp show` rounds to 5 significant digits before --only-changed compares:
    # on an AVX-512 Xeon the change vanished.)
    assert "\nkv_format: nvfp4\n" in original
    params.write_text(original.replace("\nkv_format: nvfp4\n", "\nkv_format: mxfp4\n"))
    previewed = preview(repo)  # the cost of the edit before it runs
    assert previewed["eval_ppl"] == "changed: changed deps" and previewed["report"].startswith("downstream")
    ran = stages_run(sh(repo, "dvc", "repro"))
    assert set(previewed) == ran
    assert {"check_params", "storage", "eval_ppl", "eval_gsm8k", "eval_objectives", "report"} <= ran
    assert not ran & {"prepare", "dump", "ridge", "train_projector", "train_adapters", "tune@ridge", "tune@attn_out"}
    diff = json.loads(sh(repo, "dvc", "metrics", "diff", "--json"))
    assert set(diff) == {"metrics/summary.json"} and diff["metrics/summary.json"]["csa2_fp4.dppl_pct"]["diff"] != 0
    assert "kv_format" in sh(repo, "dvc", "params", "diff")
    # README's `dvc exp show` line fits a screen: the edited workspace against HEAD
    line = re.search(r"^(dvc exp show [^#\n]*?)\s+#", (ROOT / "README.md").read_text(), re.M).group(1)
    shown = sh(repo, *shlex.split(line), "--no-pager").strip().splitlines()
    assert len(shown) <= 30 and max(map(len, shown)) <= 200, "\n".join(shown)
    # the changed ΔPPL and the edited param, not the dependency hashes or the unchanged columns
    assert any("workspace" in row for row in shown) and ".dppl_pct" in shown[0] and "kv_format" in shown[0]
    assert "/" not in shown[0] and ".kl " not in shown[0]

    params.write_text(original)  # the way back: no stage command runs, every output comes back
    previewed = preview(repo)
    assert previewed["check_params"] == previewed["eval_ppl"] == "run cache"
    out = sh(repo, "dvc", "repro")
    assert stages_run(out) == set() and "is cached - skipping run" in out
    assert {p: (repo / p).read_bytes() for p in tracked} == tracked
    assert {p: (repo / p).read_bytes() for p in cached} == cached
    assert sh(repo, "dvc", "metrics", "diff", "--json").strip() in ("", "{}")
    assert sh(repo, "git", "status", "--porcelain") == ""


def test_dropping_an_objective_reruns_only_the_objectives_evaluation_and_report(repo, reproduced):
    sh(repo, "dvc", "repro")  # settle the previous test's ablation
    params = repo / "params.yaml"
    params.write_text(params.read_text().replace("  - ridge\n  - attn_out\n  - distill\n", "  - ridge\n"))
    # check_params: any edit; eval_objectives scores every listed objective in one shared pass; release quotes
    # metrics/groups.tsv (its <group>@<objective> rows changed), so its card is rewritten
    assert stages_run(sh(repo, "dvc", "repro")) == {"check_params", "eval_objectives", "report", "release"}
    table = (repo / "reports/results.md").read_text().split("## Training objectives")[1].split("##")[0]
    objectives = {line.split("|")[2].strip() for line in table.splitlines() if line.startswith("| ced |")}
    assert objectives == {"kv_mse (seed)", "kv_mse, random init (seed read literally)", "ridge"}
