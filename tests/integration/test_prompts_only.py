"""DMD from prompts alone: a metadata file without media trains the tiny model (text from the cache); an objective
that trains on clips is refused such a file with one line, before anything is written."""
from __future__ import annotations

import json

import pytest

from tests.integration.conftest import tiny_run
from wanexp.data.metadata import PROMPT_KIND, read_prompts
from wanexp.errors import ConfigError

PROMPTS = ["a red square drifts left", "a blue circle bounces", "a green bar grows", "a white dot circles"]
T2V_DMD = ["objective=dmd", "objective.first_frame_cond=0", "objective.generator_every=1",
           "objective.student_timesteps=[1000,500]", "trainer.max_steps=2",
           "callbacks.checkpoint.every_n_train_steps=2"]


def test_prompt_files_are_read_in_every_format(tmp_path):
    (tmp_path / "p.txt").write_text("\n".join([PROMPTS[0], "", PROMPTS[1]]) + "\n")
    (tmp_path / "p.csv").write_text("prompt\n" + "\n".join(PROMPTS) + "\n")
    (tmp_path / "p.json").write_text(json.dumps(PROMPTS))
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"text": p}) for p in PROMPTS[:3]) + "\n")
    (tmp_path / "media.csv").write_text("video,prompt\na.mp4,x\n")
    counts = {}
    for name in ("p.txt", "p.csv", "p.json", "p.jsonl"):
        samples, rejects = read_prompts(tmp_path / name)
        assert not rejects and all(s.kind == PROMPT_KIND for s in samples)
        counts[name] = [s.prompt for s in samples]
    assert counts == {"p.txt": PROMPTS[:2], "p.csv": PROMPTS, "p.json": PROMPTS, "p.jsonl": PROMPTS[:3]}
    assert read_prompts(tmp_path / "media.csv") is None  # a media column: the usual reader's
    assert read_prompts(tmp_path) is None  # a folder of captioned media


def test_dmd_trains_the_tiny_model_from_a_prompts_file_through_the_text_cache(shared_dir, tmp_path, capsys):
    from tests.conftest import compose_cfg
    from wanexp.cli.cache import build_cache

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    common = [f"data.metadata={prompts}", f"data.cache_dir={tmp_path / 'cache'}", "model=tiny"]
    stats = build_cache(compose_cfg(["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models",
                                     f"paths.data_dir={shared_dir}/data", *T2V_DMD, *common]))
    assert stats["texts"] == len(PROMPTS) + 1 and not stats.get("latents")  # + DMD's negative prompt, no media
    r = tiny_run(shared_dir, tmp_path / "run", [*T2V_DMD, *common])
    out = capsys.readouterr().out
    assert f"training from prompts only ({len(PROMPTS)} prompts in {prompts}" in out
    assert "training from the cache" in out  # the text encoder never loads
    assert r["global_step"] == 2 and r["lora_files"]
    assert r["trainer"].datamodule.cached and r["trainer"].datamodule.prompts_only


@pytest.mark.parametrize("extra, says", [
    (["objective=flow_matching"], "objective=flow_matching trains on the clips themselves"),
    (["objective=dmd"], "objective.first_frame_cond=0.5 conditions TI2V samples on their clips' first frames"),
])
def test_an_objective_that_needs_clips_is_refused_a_prompts_file(shared_dir, tmp_path, extra, says):
    prompts = tmp_path / "prompts.csv"
    prompts.write_text("caption\n" + "\n".join(PROMPTS) + "\n")
    with pytest.raises(ConfigError, match="holds prompts only") as e:
        tiny_run(shared_dir, tmp_path / "run", [f"data.metadata={prompts}", "model=tiny", *extra])
    assert says in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()  # refused before the run folder was made
