"""Export directories are checked before anything is built: one that is, contains or is inside
the model the job reads (or its checkpoint directory) is refused at parse naming both keys, and
one the export at the end could not write (a file, a path under a file, a read-only disk) by
the preflight that runs before any device work -- neither creating anything."""

import os
import subprocess

import pytest

pytest.importorskip("transformers")

from tests.hf.hf_reference import DATA
from tests.support.hydra_compose import compose_job


def parse(*overrides):
    from megatron_fastpath.train import parse_job_config

    # data=jsonl: an export of a model trained on the synthetic tokens is refused (test below)
    return parse_job_config(compose_job(["training.steps=2", "metrics.wandb=off", "data=jsonl",
                                         f"data.path={DATA}", *overrides]))


def preflighted(*overrides):
    from megatron_fastpath.train import preflight

    job = parse(*overrides)
    preflight(job)
    return job


def listing(root):
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root)
                  for n in ds + fs)


@pytest.mark.parametrize("key", ["export.merged_dir", "export.adapter_dir"])
@pytest.mark.parametrize("where, how", [("", "is"), ("sub/out", "is inside"), ("..", "contains")])
def test_an_export_into_the_model_it_reads_is_refused(tiny, key, where, how):
    lora = ["fastpath.lora=true"] if key == "export.adapter_dir" else []
    before = listing(tiny)
    out = os.path.normpath(os.path.join(tiny, where))
    with pytest.raises(ValueError) as err:
        parse("model=hf", f"model.path={tiny}", *lora, f"{key}={out}")
    assert str(err.value) == (
        f"{key}={out!r} {how} model.path={tiny!r}: the job would write its files among those it "
        f"reads (and overwrite them); point {key} at a directory outside model.path")
    assert listing(tiny) == before  # nothing written


def test_a_link_to_the_model_is_the_model(tiny, tmp_path):
    os.symlink(tiny, tmp_path / "link")
    with pytest.raises(ValueError, match=r"export.merged_dir='.*/link' is model.path="):
        parse("model=hf", f"model.path={tiny}", f"export.merged_dir={tmp_path / 'link'}")


@pytest.mark.parametrize("where, how", [("", "is"), ("merged", "is inside")])
def test_an_export_into_the_checkpoint_directory_is_refused(tiny, tmp_path, where, how):
    ckpt = tmp_path / "ckpt"
    out = os.path.normpath(os.path.join(ckpt, where))
    with pytest.raises(ValueError, match=rf"^export.merged_dir='{out}' {how} checkpoint.dir='{ckpt}': "
                                         r"the job would write .*; point export.merged_dir at a "
                                         r"directory outside checkpoint.dir$"):
        parse("model=hf", f"model.path={tiny}", f"checkpoint.dir={ckpt}", f"export.merged_dir={out}")


def test_an_export_directory_that_is_a_file_is_refused_before_the_build(tiny, tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"^export.merged_dir='.*/f' is a file, not a directory: "
                                         r"point export.merged_dir at a directory"):
        preflighted("model=hf", f"model.path={tiny}", f"export.merged_dir={tmp_path / 'f'}")
    with pytest.raises(ValueError, match=r"^export.adapter_dir='.*/f/sub/out' cannot be created "
                                         r"\(.*/f is a file, not a directory\)"):
        preflighted("model=hf", f"model.path={tiny}", "fastpath.lora=true",
                    f"export.adapter_dir={tmp_path / 'f' / 'sub' / 'out'}")
    assert (tmp_path / "f").read_text() == "x"


def test_a_good_export_directory_is_not_created_before_the_run(tiny, tmp_path):
    job = preflighted("model=hf", f"model.path={tiny}", f"export.merged_dir={tmp_path / 'a' / 'b'}")
    assert job.export.merged_dir == str(tmp_path / "a" / "b")
    assert os.listdir(tmp_path) == []


def test_an_export_directory_on_a_read_only_disk_is_refused_before_the_build(tiny, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        with pytest.raises(ValueError, match=r"^export.merged_dir='.*/ro/out' is not writable "
                                             r"\(Read-only file system: .*/ro\)"):
            preflighted("model=hf", f"model.path={tiny}", f"export.merged_dir={ro / 'out'}")
    finally:
        subprocess.run(["umount", str(ro)], check=True)


@pytest.mark.integration
def test_the_main_job_reports_it_in_one_line_with_exit_2(tiny, tmp_path):
    from tests.support.main_job import run_main_job

    before = listing(tiny)
    job = run_main_job(["model=hf", f"model.path={tiny}", "data=jsonl", f"data.path={DATA}",
                        f"export.merged_dir={tiny}",
                        "training.steps=2", "metrics.wandb=off"], tmp_path, check=False, timeout=300)
    assert job.returncode == 2, job.output[-3000:]
    assert (f"error: export.merged_dir={tiny!r} is model.path={tiny!r}: the job would write its "
            "files among those it reads (and overwrite them); point export.merged_dir at a "
            "directory outside model.path\n") in job.stderr
    assert "Traceback" not in job.output and "| loss " not in job.stdout
    assert listing(tiny) == before
