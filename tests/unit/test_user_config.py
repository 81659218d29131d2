"""The user's own config folder (./conf of the current folder, or $WANEXP_CONFIG_DIR) on Hydra's search path for every
command that composes a run; the data templates (data=folder, data=csv) and ``python -m wanexp.cli.dataset init``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import HydraException

from tests.conftest import compose_cfg
from wanexp.config import CONF_DIR, check_config, check_optional_groups, one_line_error
from wanexp.config.folders import user_config_dir, with_user_config_dir
from wanexp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _user_folder(base: Path) -> Path:
    conf = base / "conf"
    (conf / "data").mkdir(parents=True)
    (conf / "experiment").mkdir()
    (conf / "model").mkdir()
    (conf / "data" / "my_clips.yaml").write_text("defaults:\n  - folder\n  - _self_\nname: my_clips\n"
                                                 f"metadata: {base / 'clips'}\nnum_frames: 9\n")
    (conf / "experiment" / "mine.yaml").write_text("# @package _global_\nseed: 7\n")
    (conf / "model" / "my_tiny.yaml").write_text("defaults:\n  - tiny\n  - _self_\nname: my_tiny\n")
    return conf


@pytest.fixture
def in_user_folder(tmp_path, monkeypatch) -> Path:
    """A current folder with a conf/ of the user's (its path holds a space and a comma: quoted on the search path)."""
    base = tmp_path / "my project, v2"
    _user_folder(base)
    monkeypatch.chdir(base)
    monkeypatch.delenv("WANEXP_CONFIG_DIR", raising=False)
    return base


def test_every_group_finds_the_users_options_in_their_conf_folder(in_user_folder):
    cfg = compose_cfg(["data=my_clips", "model=my_tiny", "experiment=mine"])
    assert (cfg.data.name, cfg.data.metadata, cfg.data.num_frames) == ("my_clips", f"{in_user_folder}/clips", 9)
    assert (cfg.model.name, cfg.seed) == ("my_tiny", 7)
    assert cfg.data.caption_extension == ".txt" and cfg.data.height == 704  # the template's and mbc_5k's keys
    from wanexp.config import model_group_files

    assert "my_tiny" in model_group_files() and "tiny" in model_group_files()  # what wanexp-sample looks through


def test_the_checkout_conf_folder_is_not_added_twice(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WANEXP_CONFIG_DIR", raising=False)
    assert (ROOT / "conf").is_dir() and user_config_dir() is None
    assert with_user_config_dir(["data=mbc_5k"]) == ["data=mbc_5k"]
    assert compose_cfg(["data=folder", "data.metadata=/x"]).data.name == "folder"


def test_the_search_path_entry_goes_beside_the_overrides(tmp_path):
    conf = _user_folder(tmp_path)
    entry = f"hydra.searchpath=['file://{conf}']"
    assert with_user_config_dir(["--cfg", "job"], cwd=tmp_path, environ={}) == [entry, "--cfg", "job"]
    assert with_user_config_dir(["-m", "a=1", "b=2"], cwd=tmp_path, environ={}) == ["-m", entry, "a=1", "b=2"]
    extended = with_user_config_dir(["a=1", "hydra.searchpath=[pkg://x]"], cwd=tmp_path, environ={})
    assert extended == ["a=1", f"hydra.searchpath=['pkg://x','file://{conf}']"]
    named = ["a=1", f"hydra.searchpath=[file://{conf}]"]
    assert with_user_config_dir(named, cwd=tmp_path, environ={}) == named  # named already: unchanged
    assert with_user_config_dir(["a=1"], cwd=tmp_path / "elsewhere", environ={}) == ["a=1"]  # no ./conf


def test_wanexp_config_dir_names_the_folder(tmp_path, monkeypatch):
    conf = _user_folder(tmp_path / "mine")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANEXP_CONFIG_DIR", str(conf))
    assert compose_cfg(["data=my_clips"]).data.name == "my_clips"
    monkeypatch.setenv("WANEXP_CONFIG_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"^WANEXP_CONFIG_DIR=.*/nowhere: no such folder; point it at the folder"):
        compose_cfg(["data=my_clips"])


def test_an_unknown_option_names_the_folders_looked_in(in_user_folder):
    conf = in_user_folder / "conf"
    with pytest.raises(HydraException) as e:
        compose_cfg(["data=my_clipz"])
    assert one_line_error(e.value) == (f"data=my_clipz: no such option (looked in conf/data/, {conf}/data/); allowed "
                                       "values are csv, folder, mbc_5k, mbc_full, my_clips, synthetic")
    with pytest.raises(ConfigError) as e:  # an optional group's option
        compose_cfg(["experiment=minee"])
    assert str(e.value) == (f"experiment=minee: no such experiment option (conf/experiment/minee.yaml, nor in "
                            f"{conf}/experiment); the options: demo, demo_squares, mine")
    check_optional_groups(with_user_config_dir(["experiment=mine"]))


def test_train_py_run_from_the_users_folder_composes_their_groups(tmp_path):
    """The commands' own entry (hydra_main, as train.py, wanexp-cache, wanexp-plan use it): one process each."""
    conf = _user_folder(tmp_path)
    (conf / "data" / "synthetic.yaml").write_text("name: mine\n")  # a shipped option's name: not used, said so
    env = {k: v for k, v in os.environ.items() if k != "WANEXP_CONFIG_DIR"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "data=my_clips", "model=tiny", "--cfg", "job"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "name: my_clips\n" in done.stdout and f"metadata: {tmp_path}/clips\n" in done.stdout
    assert done.stdout.splitlines()[0] == (f"wanexp: warning: not used, wanexp ships an option of the same name: "
                                           f"{conf}/data/synthetic.yaml; rename yours")
    done = subprocess.run([sys.executable, "-m", "wanexp.cli.cache", "data=my_clipz"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and done.stderr == (
        f"wanexp: error: data=my_clipz: no such option (looked in conf/data/, {conf}/data/); allowed values are "
        "csv, folder, mbc_5k, mbc_full, my_clips, synthetic\n")


@pytest.mark.parametrize("template", ["folder", "csv"])
def test_a_template_without_its_path_is_one_line(template):
    with pytest.raises(ConfigError, match=rf"^data.metadata is not set: data={template} reads your own data; pass "
                                          r"data.metadata=/path/to/it \(a folder of clips"):
        check_config(compose_cfg([f"data={template}", "model.path=/m"]))


def test_a_folder_with_other_caption_files_reads_with_caption_extension(tmp_path):
    from wanexp.composition import build

    for stem in ("a", "b"):
        (tmp_path / f"{stem}.png").write_bytes(b"")
        (tmp_path / f"{stem}.caption").write_text(f"caption {stem}")
    cfg = compose_cfg(["data=folder", f"data.metadata={tmp_path}", "data.caption_extension=.caption"])
    dm = build(cfg.data, _partial_=True, seed=0)(encoders=None)
    from wanexp.data.metadata import read_metadata_with_rejects

    samples, rejects = read_metadata_with_rejects(dm.parts[0].metadata, caption_extension=dm.parts[0].caption_extension)
    assert [s.prompt for s in samples] == ["caption a", "caption b"] and not rejects
    assert [r.reason for r in read_metadata_with_rejects(tmp_path)[1]] == ["no caption file 'a.txt'",
                                                                           "no caption file 'b.txt'"]
    with pytest.raises(ConfigError, match=r"^data.caption_extension='caption': a file extension with its dot"):
        build(cfg.data, _partial_=True, seed=0, caption_extension="caption")(encoders=None)


def test_init_writes_a_group_for_a_folder_from_what_it_holds(tmp_path, monkeypatch, capsys):
    from wanexp.cli.dataset import main
    from wanexp.composition import build
    from wanexp.data.metadata import read_metadata
    from wanexp.data.synthetic import make_demo_dataset

    wide = make_demo_dataset(tmp_path / "gen_wide", num_videos=2, num_images=1, num_frames=5, height=32, width=64)
    tall = make_demo_dataset(tmp_path / "gen_tall", num_videos=1, num_images=0, num_frames=5, height=64, width=32)
    clips = tmp_path / "my clips"
    for i, s in enumerate(read_metadata(wide) + read_metadata(tall)):  # a folder of media + .caption files
        (clips / "sub").mkdir(parents=True, exist_ok=True)
        media = clips / ("sub" if i == 3 else ".") / f"m{i}{Path(s.path).suffix}"
        media.write_bytes(Path(s.path).read_bytes())
        media.with_suffix(".caption").write_text(s.prompt)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANEXP_CONFIG_DIR", raising=False)
    out = main(["init", str(clips), "--name", "my_clips"])
    assert out == tmp_path / "conf" / "data" / "my_clips.yaml"
    said = capsys.readouterr().out
    assert said.startswith(f"wanexp: wrote {out}: 1 image, 3 videos; of the first 4: 3 landscape, 1 portrait")
    cfg = compose_cfg(["data=my_clips", "model.path=/m"])
    assert (cfg.data.metadata, cfg.data.caption_extension) == (str(clips), ".caption")
    assert cfg.data.buckets == [[704, 1280], [1280, 704], [960, 960]]  # both orientations
    dm = build(cfg.data, _partial_=True, seed=0)(encoders=None)
    from wanexp.data.metadata import read_metadata_with_rejects

    samples, rejects = read_metadata_with_rejects(dm.metadata, caption_extension=dm.caption_extension)
    assert len(samples) == 4 and not rejects
    # a metadata file beside the media: the csv template, that file
    out = main(["init", str(wide.parent), "--name", "wide", "--conf-dir", str(tmp_path / "c")])
    assert "defaults: [csv, _self_]\nname: wide\nmetadata: " + str(wide) in out.read_text()
    assert "buckets" not in out.read_text()  # one orientation


@pytest.mark.parametrize("args, says", [
    (["init", "{tmp}/nowhere"], "{tmp}/nowhere: no such folder or file"),
    (["init", "{tmp}/empty"], "{tmp}/empty: no caption files beside its media (looked for .txt, .caption"),
    (["init", "{tmp}/empty", "--name", "folder"], "--name folder: wanexp ships data=folder"),
    (["init", "{tmp}/empty", "--name", "a b"], "--name 'a b': letters, digits, _ and -"),
])
def test_init_refuses_in_one_line(tmp_path, capsys, args, says):
    from wanexp.cli.dataset import main

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.mp4").write_bytes(b"")
    with pytest.raises(SystemExit) as stop:
        main([a.format(tmp=tmp_path) for a in args] + ["--conf-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("wanexp: error: " + says.format(tmp=tmp_path)), err
    assert err.count("\n") == 1 and not (tmp_path / "c").exists()
    assert CONF_DIR.is_dir()
