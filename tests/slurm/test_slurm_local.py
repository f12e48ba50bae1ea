"""slurm/train.sbatch, for real: a two-node Slurm cluster on loopback (installed with apt and
started by this module, stopped at the end) runs the main job on CPU, 2 nodes x 2 tasks with
gloo -- data parallel, and expert parallel when the tiny MoE config exists -- plus one
torchrun-per-node job. Every rank must log every step and a falling loss.

Fast checks need no Slurm: shellcheck over slurm/, the script's input errors, and the exact
srun/torchrun command line and environment it builds for a GPU job (fake srun/scontrol).

Where Slurm cannot be installed (no root, no apt-get, FASTPATH_SLURM_NO_INSTALL=1) or does not
start, the cluster tests are skipped with the reason.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.slurm_cluster import (
    LocalSlurmCluster,
    SlurmUnavailable,
    apt_install,
    clean_submit_env,
    ensure_installed,
    find_binary,
)

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "slurm" / "train.sbatch"
LORA_SBATCH = REPO / "slurm" / "train_cuda_graphs_lora.sbatch"
SHELL_SCRIPTS = sorted(p for p in (REPO / "slurm").rglob("*") if p.suffix in (".sbatch", ".sh"))
TINY_MOE = REPO / "megatron_fastpath" / "configs" / "model" / "tiny_moe.yaml"
LORA_PRESET = ("model=llama3_8b", "fastpath.lora=true", "fastpath.cuda_graphs=true",
               "cuda_graphs.warmup_steps=0", "training.dtype=bfloat16")

STEPS = 8
FAST = [f"training.steps={STEPS}", "model.num_layers=2", "data.num_samples=256",
        "training.log_all_ranks=true"]
STEP_RE = re.compile(r"\[rank (\d+)\] step\s+(\d+)/(\d+) \| loss ([0-9.]+)")
HEADER_RE = re.compile(
    r"\[rank (\d+)\] megatron_fastpath: (\d+) layers, .*\(world (\d+), dp (\d+)(?:, ep (\d+))?\)"
)
BANNER_RE = re.compile(
    r"fastpath: job (\d+) on (\d+) nodes \((\S+)\), launcher (\w+), device (\w+), "
    r"rendezvous (\S+):(\d+), run dir (\S+)"
)


# ------------------------------------------------------------------------------------------------
# shellcheck and the script's own checks (no Slurm needed)
# ------------------------------------------------------------------------------------------------
def test_slurm_scripts_are_shellcheck_clean():
    assert SBATCH in SHELL_SCRIPTS
    exe = find_binary("shellcheck")
    if exe is None:
        try:
            apt_install(["shellcheck"])
        except SlurmUnavailable as e:
            pytest.skip(f"shellcheck not installed and cannot be installed: {e}")
        exe = find_binary("shellcheck")
        assert exe is not None, "apt-get installed shellcheck but it is not on PATH"
    proc = subprocess.run([exe, "--shell=bash", "--severity=style", *map(str, SHELL_SCRIPTS)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _run_script(env_extra: dict[str, str], *args: str, path_dir: Path | None = None):
    env = clean_submit_env(**env_extra)
    if path_dir is not None:
        env["PATH"] = f"{path_dir}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(["bash", str(SBATCH), *args], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize(
    "env, match",
    [
        ({}, "submit it with sbatch"),
        ({"SLURM_JOB_ID": "7", "DEVICE": "tpu"}, "DEVICE must be cuda or cpu, got 'tpu'"),
        ({"SLURM_JOB_ID": "7", "LAUNCHER": "mpirun"}, "LAUNCHER must be srun or torchrun, got 'mpirun'"),
    ],
)
def test_script_rejects_bad_input_before_launching(env, match, tmp_path):
    fake_bin = _fake_slurm_bin(tmp_path)
    proc = _run_script(env, "training.steps=3", path_dir=fake_bin)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert match in proc.stderr
    assert not (tmp_path / "srun.calls").exists()  # nothing was launched


def _fake_slurm_bin(tmp_path: Path) -> Path:
    """``scontrol`` answering for nodes gpu-a, gpu-b (NodeAddr 10.1.2.3) and an ``srun`` that
    records its argv and the environment it would hand to the tasks."""
    d = tmp_path / "bin"
    d.mkdir()
    (d / "scontrol").write_text(
        "#!/usr/bin/env bash\n"
        'if [[ $1 == show && $2 == hostnames ]]; then printf "gpu-a\\ngpu-b\\n"; exit 0; fi\n'
        'if [[ $1 == show && $2 == node ]]; then\n'
        '  echo "NodeName=$3 Arch=x86_64 CoresPerSocket=8"\n'
        '  echo "   NodeAddr=10.1.2.3 NodeHostName=$3 Version=23.02"; exit 0; fi\n'
        "exit 1\n"
    )
    (d / "srun").write_text(
        "#!/usr/bin/env bash\n"
        f'out={tmp_path}/srun.calls\n'
        'printf "%s\\n" "$@" > "$out"\n'
        'env | sort > "$out.env"\n'
    )
    for f in ("scontrol", "srun"):
        (d / f).chmod(0o755)
    return d


def _job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NAME": "fastpath-train", "LOG_DIR": str(tmp_path / "logs"),
        "PYTHON": "/opt/venv/bin/python", **extra,
    }


def _calls(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    argv = (tmp_path / "srun.calls").read_text().splitlines()
    env = dict(line.split("=", 1) for line in (tmp_path / "srun.calls.env").read_text().splitlines()
               if "=" in line)
    return argv, env


def test_srun_command_line_and_environment_for_a_gpu_job(tmp_path):
    fake_bin = _fake_slurm_bin(tmp_path)
    env = _job_env(tmp_path, RANK="5", WORLD_SIZE="9", CONT="nvcr.io/nvidia/pytorch:25.01-py3",
                   CONT_MOUNTS="/data:/data,/home:/home", SRUN_ARGS="--mpi=pmix --label")
    proc = _run_script(env, "model=tiny_moe", "training.device=cpu", "training.summary_json=/x y.json",
                       path_dir=fake_bin)
    assert proc.returncode == 0, proc.stderr
    argv, job_env = _calls(tmp_path)
    run_dir = f"{tmp_path}/logs/fastpath-train-123456"
    assert argv == [
        "--kill-on-bad-exit=1",
        "--container-image=nvcr.io/nvidia/pytorch:25.01-py3",
        "--container-mounts=/data:/data,/home:/home",
        "--mpi=pmix", "--label",
        "/opt/venv/bin/python", "-m", "megatron_fastpath.train",
        "cluster=slurm", "training.device=cuda", f"hydra.run.dir={run_dir}",
        f"checkpoint.dir={run_dir}/checkpoints",
        # the caller's overrides come last (Hydra: the last value wins), spaces intact
        "model=tiny_moe", "training.device=cpu", "training.summary_json=/x y.json",
    ]
    assert os.path.isdir(run_dir)
    assert job_env["MASTER_ADDR"] == "10.1.2.3"  # NodeAddr of the first node
    assert job_env["MASTER_PORT"] == str(20000 + 123456 % 20000)
    assert "RANK" not in job_env and "WORLD_SIZE" not in job_env  # ranks come from Slurm
    for name, value in [("CUDA_DEVICE_MAX_CONNECTIONS", "1"), ("TORCH_NCCL_AVOID_RECORD_STREAMS", "1"),
                        ("NCCL_GRAPH_REGISTER", "0"),
                        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
                        ("PYTHONUNBUFFERED", "1")]:
        assert job_env.get(name) == value, name
    assert "CUDA_VISIBLE_DEVICES" not in job_env
    assert "launcher srun, device cuda, rendezvous 10.1.2.3:23456" in proc.stdout


def test_torchrun_per_node_and_cpu_mode_command_line(tmp_path):
    fake_bin = _fake_slurm_bin(tmp_path)
    env = _job_env(tmp_path, LAUNCHER="torchrun", DEVICE="cpu", NPROC_PER_NODE="4",
                   PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False")
    proc = _run_script(env, "training.steps=5", path_dir=fake_bin)
    assert proc.returncode == 0, proc.stderr
    argv, job_env = _calls(tmp_path)
    assert argv == [
        "--kill-on-bad-exit=1", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
        "/opt/venv/bin/python", "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=4",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=10.1.2.3:{20000 + 123456 % 20000}",
        "--rdzv_id=123456", "-m", "megatron_fastpath.train",
        "cluster=slurm", "training.device=cpu", f"hydra.run.dir={tmp_path}/logs/fastpath-train-123456",
        f"checkpoint.dir={tmp_path}/logs/fastpath-train-123456/checkpoints",
        "training.steps=5",
    ]
    assert job_env["CUDA_VISIBLE_DEVICES"] == ""  # CPU mode hides GPUs: gloo
    assert job_env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"  # caller's value kept


def test_torchrun_needs_processes_per_node(tmp_path):
    fake_bin = _fake_slurm_bin(tmp_path)
    proc = _run_script(_job_env(tmp_path, LAUNCHER="torchrun", DEVICE="cpu"), path_dir=fake_bin)
    assert proc.returncode == 2 and "set NPROC_PER_NODE" in proc.stderr
    assert not (tmp_path / "srun.calls").exists()


def _preset_argv(tmp_path, script, job_name: str) -> tuple:
    """(the main job's arguments, the run directory) when ``script training.steps=3`` is run
    as Slurm job ``job_name`` (id 123456) with the fake srun."""
    fake_bin = _fake_slurm_bin(tmp_path)
    env = _job_env(tmp_path, SLURM_JOB_NAME=job_name, FASTPATH_HOME=str(REPO))
    proc = subprocess.run(["bash", str(script), "training.steps=3"], capture_output=True,
                          text=True, timeout=60,
                          env=dict(clean_submit_env(**env), PATH=f"{fake_bin}:{os.environ['PATH']}"))
    assert proc.returncode == 0, proc.stderr
    argv, _ = _calls(tmp_path)
    return argv[argv.index("megatron_fastpath.train") + 1:], f"{tmp_path}/logs/{job_name}-123456"


def test_lora_graphs_preset_forwards_to_train_sbatch_and_composes(tmp_path):
    from tests.support.hydra_compose import compose_job

    tail, run_dir = _preset_argv(tmp_path, LORA_SBATCH, "fastpath-lora-graphs")
    assert tail == ["cluster=slurm", "training.device=cuda", f"hydra.run.dir={run_dir}",
                    f"checkpoint.dir={run_dir}/checkpoints", *LORA_PRESET, "training.steps=3"]
    cfg = compose_job([*LORA_PRESET, "training.device=cuda"])
    assert cfg.fastpath.lora and cfg.fastpath.cuda_graphs and cfg.training.dtype == "bfloat16"
    assert cfg.cuda_graphs.warmup_steps == 0  # LoRA + capture needs it on megatron-core 0.16.1
    assert cfg.model.num_layers == 32  # Llama-3-8B


CP_SBATCH = REPO / "slurm" / "train_context_parallel.sbatch"
CP_PRESET = ("model=llama3_8b", "fastpath.lora=true", "training.dtype=bfloat16",
             "parallel.context_parallel_size=2", "parallel.tensor_model_parallel_size=2",
             "fastpath.attention_backend=sdpa",
             "data.max_tokens=16384", "data.max_len=8192")


def test_context_parallel_preset_forwards_parses_and_fits_an_80gb_gpu(tmp_path):
    """The CP example: its overrides reach the main job after train.sbatch's, the main
    job's parse accepts them on CUDA (the CP rule serves dense + sdpa + LoRA), and the memory
    estimate of one rank (CP counted) fits an 80 GB GPU."""
    from megatron_fastpath.train import parse_job_config
    from megatron_fastpath.train.memory import check_memory
    from tests.support.cuda_as_cpu import cuda_as_cpu
    from tests.support.hydra_compose import compose_job

    tail, run_dir = _preset_argv(tmp_path, CP_SBATCH, "fastpath-context-parallel")
    assert tail == ["cluster=slurm", "training.device=cuda", f"hydra.run.dir={run_dir}",
                    f"checkpoint.dir={run_dir}/checkpoints", *CP_PRESET, "training.steps=3"]
    with cuda_as_cpu():
        job = parse_job_config(compose_job([*CP_PRESET, "training.device=cuda",
                                            "training.skip_memory_check=true"]))
        est = check_memory(job, available=80 * 10**9)  # one rank per 80 GB GPU: no error
    assert job.attention_backend == "sdpa" and job.parallel.context_parallel_size == 2
    assert job.parallel.tensor_model_parallel_size == 2
    assert job.lora is not None and job.data.max_tokens == 16384
    assert 8 * 10**9 < est.total < 80 * 10**9  # bf16 8B weights over TP 2 (8 GB) and more


def test_lora_graphs_preset_needs_the_repository(tmp_path):
    env = _job_env(tmp_path, FASTPATH_HOME=str(tmp_path / "nowhere"))
    proc = subprocess.run(["bash", str(LORA_SBATCH)], env=clean_submit_env(**env),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"{tmp_path}/nowhere/slurm/train.sbatch not found" in proc.stderr


def test_missing_slurm_gives_a_skip_reason_not_a_pass(monkeypatch):
    from tests.slurm import slurm_cluster

    monkeypatch.setattr(slurm_cluster, "_SLURM_BINARIES", ("sbatch", "no-such-slurm-binary"))
    monkeypatch.setenv("FASTPATH_SLURM_NO_INSTALL", "1")
    with pytest.raises(SlurmUnavailable, match="not installed and FASTPATH_SLURM_NO_INSTALL=1"):
        ensure_installed()
    monkeypatch.delenv("FASTPATH_SLURM_NO_INSTALL")
    monkeypatch.delenv("FASTPATH_SLURM_INSTALL", raising=False)
    with pytest.raises(SlurmUnavailable, match="set FASTPATH_SLURM_INSTALL=1"):
        ensure_installed()
    monkeypatch.setenv("FASTPATH_SLURM_INSTALL", "1")
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(SlurmUnavailable, match="not root"):
        ensure_installed()
    with pytest.raises(SlurmUnavailable, match="needs root"):
        LocalSlurmCluster("/nonexistent/fastpath-slurm").start()


def test_submit_env_drops_rank_and_enclosing_slurm_variables():
    env = clean_submit_env(
        {"PATH": "/bin", "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "1234", "SLURM_JOB_ID": "9",
         "SBATCH_PARTITION": "gpu", "TORCHELASTIC_RUN_ID": "x", "OMP_NUM_THREADS": "2"},
        PYTHON="/venv/bin/python",
    )
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "2", "PYTHON": "/venv/bin/python"}


# ------------------------------------------------------------------------------------------------
# The real thing: a local two-node Slurm cluster
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    script: Path
    job_name: str  # the script's --job-name: names the output file and the run directory
    launcher: str
    tasks_per_node: int
    procs_per_node: int  # processes per task (torchrun); 1 with srun
    overrides: tuple = ()
    min_loss_drop: float = 0.5  # step-1 loss minus step-8 loss must exceed this
    preset: tuple = ()  # overrides the script itself adds

    @property
    def world(self) -> int:
        return 2 * self.tasks_per_node * self.procs_per_node


CASES = [
    pytest.param(Case(SBATCH, "fastpath-train", "srun", 2, 1), id="srun-2x2-dp4"),
    pytest.param(
        Case(SBATCH, "fastpath-train", "srun", 2, 1,
             ("model=tiny_moe", "parallel.expert_model_parallel_size=2")),
        id="srun-2x2-ep2-moe",
        marks=pytest.mark.skipif(not TINY_MOE.exists(),
                                 reason=f"{TINY_MOE.relative_to(REPO)} does not exist yet"),
    ),
    pytest.param(Case(SBATCH, "fastpath-train", "torchrun", 1, 2), id="torchrun-2x1x2-dp4"),
    # The preset wrapper (LoRA + CUDA graphs; on CPU the graph-safety audit) with a tiny model:
    # only the adapters train, so the loss falls slowly.
    pytest.param(Case(LORA_SBATCH, "fastpath-lora-graphs", "srun", 1, 1, ("model=tiny_dense",),
                      min_loss_drop=0.0, preset=LORA_PRESET), id="lora-graphs-preset-srun-2x1"),
]


@pytest.mark.integration
@pytest.mark.parametrize("case", CASES)
def test_sbatch_trains_on_local_two_node_slurm(local_slurm, tmp_path, case: Case):
    work = tmp_path / "submit"
    work.mkdir(parents=True)  # nothing else: the script's default --output is %x-%j.out here
    env = clean_submit_env(
        PYTHON=sys.executable, DEVICE="cpu", LAUNCHER=case.launcher,
        NPROC_PER_NODE=str(case.procs_per_node), FASTPATH_HOME=str(REPO),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    world, overrides = case.world, list(case.overrides)
    t0 = time.perf_counter()
    job_id = local_slurm.sbatch(
        [f"--chdir={work}", "--nodes=2", f"--ntasks-per-node={case.tasks_per_node}",
         "--gpus-per-node=0", "--time=00:08:00", str(case.script), *FAST, *overrides],
        env=env,
    )
    job = local_slurm.wait(job_id, timeout_s=600)  # Slurm's --time ends a hung job first
    elapsed = time.perf_counter() - t0
    out_file = work / f"{case.job_name}-{job_id}.out"
    out = out_file.read_text() if out_file.exists() else ""
    print(f"\njob {job_id} ({case.script.name}, {case.launcher}, world {world}): {job.state} "
          f"{job.exit_code} in {elapsed:.1f} s")
    assert job.ok, f"job {job_id}: {job.state} exit {job.exit_code}\n{out[-4000:]}\n{local_slurm.log_tails()}"

    # Slurm's view: both nodes, the requested number of tasks.
    assert job.fields["NumNodes"] == "2" and job.fields["NodeList"] == "node[1-2]", job.fields
    assert job.fields["NumTasks"] == str(2 * case.tasks_per_node), job.fields

    # The script's banner: rendezvous at node1's NodeAddr, port from the job id.
    banner = BANNER_RE.search(out)
    assert banner, out[:2000]
    assert banner.groups()[:6] == (str(job_id), "2", "node[1-2]", case.launcher, "cpu", "127.0.0.1")
    assert int(banner.group(7)) == 20000 + job_id % 20000

    # Hydra overrides reached every rank: world size, 2 layers, 8 steps.
    headers = {int(m.group(1)): m.groups()[1:] for m in HEADER_RE.finditer(out)}
    assert sorted(headers) == list(range(world)), out[-3000:]
    assert all(h[0] == "2" and h[1] == str(world) for h in headers.values()), headers
    if not any(o.startswith("parallel.") for o in overrides):
        assert all(h[2] == str(world) for h in headers.values()), headers  # pure data parallel
    expected_ep = "2" if "parallel.expert_model_parallel_size=2" in overrides else "1"
    assert all(h[3] == expected_ep for h in headers.values()), headers

    losses: dict[int, dict[int, float]] = {}
    for m in STEP_RE.finditer(out):
        rank, step, total, loss = int(m.group(1)), int(m.group(2)), int(m.group(3)), float(m.group(4))
        assert total == STEPS
        losses.setdefault(rank, {})[step] = loss
    assert sorted(losses) == list(range(world)), f"ranks that logged steps: {sorted(losses)}"
    for rank, by_step in losses.items():
        assert sorted(by_step) == list(range(1, STEPS + 1)), (rank, sorted(by_step))
        assert by_step[STEPS] < by_step[1] - case.min_loss_drop, (rank, by_step)
        assert f"[rank {rank}] summary: {STEPS} steps" in out

    # One Hydra run directory per job, holding the overrides the job ran with.
    hydra_overrides = work / "logs" / f"{case.job_name}-{job_id}" / ".hydra" / "overrides.yaml"
    text = hydra_overrides.read_text()
    for o in ["training.device=cpu", *case.preset, *FAST, *overrides]:
        assert f"- {o}\n" in text, (o, text)
