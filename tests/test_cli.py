"""python -m offload demo: trains a model larger than its device budget on NVMe, the loss falls, nothing is left."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from offload.cli import main
from offload.planner import DecoderShape, estimate, table
from models import make

ROOT = Path(__file__).resolve().parent.parent


def test_demo_trains_beyond_the_device_budget(tmp_path, capsys):
    rc = main(["demo", "--layers", "2", "--width", "128", "--vocab", "256", "--steps", "12", "--batch", "8",
               "--tokens", "32", "--lr", "1e-3", "--device-budget", "512KiB", "--swap-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out  # 0: the loss fell
    assert "x smaller" in out and "memory per tier" in out and "where the time went" in out
    ratio = float(out.split(" (")[1].split("x smaller")[0])
    assert ratio >= 8  # parameters + optimizer state exceed the device budget 8x or more
    assert list(tmp_path.iterdir()) == []  # the swap directory is removed at the end


def test_module_entry_point_and_bad_input(tmp_path):
    done = subprocess.run([sys.executable, "-m", "offload", "demo", "--device-budget", "lots"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "--device-budget must be a byte count" in done.stderr


def test_demo_and_export_flags_are_checked_before_any_work(tmp_path, capsys):
    """Sizes below 1, a width the heads do not split, a file as the swap folder and a ``.safetensors`` name for a
    safetensors export (a folder) each get a one-line error naming the flag or path."""
    (tmp_path / "file").write_text("x")
    for flags, message in ((["--steps", "0"], "--steps must be at least 1, got 0"),
                           (["--tokens", "-3"], "--tokens must be at least 1, got -3"),
                           (["--width", "129"], "--width 129 does not split into 2 attention heads"),
                           (["--swap-dir", str(tmp_path / "file")], f"--swap-dir: {tmp_path / 'file'} is a file")):
        assert main(["demo", *flags]) == 2
        assert message in capsys.readouterr().err, flags
    assert main(["export", str(tmp_path), str(tmp_path / "model.safetensors")]) == 2
    assert f"{tmp_path / 'model.safetensors'} names a file, but a safetensors export is a folder" in \
        capsys.readouterr().err
    assert not (tmp_path / "model.safetensors").exists()
    assert main(["estimate", "--params", "3e9", "--gpu-mem", "24"]) == 2  # 24 bytes: a unit left out
    assert "--gpu-mem 24 is 24 bytes: give a unit, e.g. 24GiB" in capsys.readouterr().err
    assert main(["estimate", "--params", "3e9", "--host-mem", "512KiB"]) == 2  # a unit given: no unit to add
    assert "--host-mem 512KiB is 524288 bytes: a machine has at least 1 MiB; give its size" in capsys.readouterr().err
    for argv, message in ((["tune", "--nvme-path", str(tmp_path / "file"), "--quick"],
                           f"tune --nvme-path: {tmp_path / 'file'} is a file, not a folder"),
                          (["bench", "adam", "--out", str(tmp_path / "file")],
                           f"bench --out: {tmp_path / 'file'} is a file, not a folder"),
                          (["demo", "--device-budget", "1KiB", "--steps", "1"], "raise --device-budget to at least")):
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    assert main(["estimate", "--model", str(tmp_path)]) == 2
    assert f'--model {tmp_path / "config.json"}: a transformers config.json names its architecture under ' \
        '"model_type"' in capsys.readouterr().err


def test_demo_with_a_config_reports_its_placement_and_lends_it_the_swap_folder(tmp_path, capsys):
    """``--config`` without an nvme_path for its NVMe section trains with the demo's own swap folder (removed at
    the end), and the header names the config's placement, not --placement's default."""
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, '
                   '"offload_param": {"device": "nvme"}}, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}}')
    swap = tmp_path / "swap"
    rc = main(["demo", "--config", str(cfg), "--steps", "3", "--layers", "1", "--width", "64", "--vocab", "128",
               "--swap-dir", str(swap)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "optimizer state on host, parameters on nvme (from" in out and "swap files" in out
    assert list(swap.iterdir()) == []


def test_estimate_command(tmp_path, capsys):
    rc = main(["estimate", "--params", "3e9", "--gpu-mem", "24GiB", "--host-mem", "24GiB", "--nvme-free", "80GB"])
    out = capsys.readouterr().out
    assert rc == 0 and "best: optimizer on nvme" in out and '"device": "nvme"' in out
    rc = main(["estimate", "--model", "offload.models:GPT", "--gpu-mem", "1GiB"])
    assert rc == 2  # GPT needs a config: the error is reported, not raised
    # sizes the flags leave unset are derived as initialize derives them (the CLI charged 1e8-element sub-groups
    # and 4 staging buffers: 5.6 GiB of host memory for the optimizer on NVMe where the engine takes 0.9 GiB)
    capsys.readouterr()
    assert main(["estimate", "--params", "1e9", "--gpu-mem", "8GiB", "--host-mem", "6GiB", "--nvme-free", "1TB"]) == 0
    assert table(estimate(10**9, gpu_mem=8 << 30, host_mem=6 << 30, nvme_free=10**12,
                          largest_param=DecoderShape.typical(10**9).largest_param)) in capsys.readouterr().out
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--max-shard-size", "10XB"]) == 2
    assert "--max-shard-size must be a byte count" in capsys.readouterr().err
    # the largest parameter sets the device's room for one gradient: without it the model counts as one parameter
    here = {"gpu_mem": torch.cuda.get_device_properties(0).total_memory} if torch.cuda.is_available() else \
        {"cuda": False}  # as the CLI plans: for this machine
    one = {e.placement: e for e in estimate(10**9, **here)}
    cut = {e.placement: e for e in estimate(10**9, largest_param=10**8, **here)}
    assert cut["optimizer on cpu"].device == one["optimizer on cpu"].device - 2 * (10**9 - 10**8)
    assert main(["estimate", "--params", "1e9", "--largest-param", "1e8"]) == 0
    assert table(list(cut.values())) in capsys.readouterr().out
    assert main(["estimate", "--params", "1e9", "--largest-param", "2e9"]) == 2
    assert "--largest-param must be a number of elements in [1, --params], got '2e9'" in capsys.readouterr().err
    for bad in ("abc", "-5", "0"):
        assert main(["estimate", "--params", bad]) == 2
        assert f"--params must be a positive number of parameters such as 7e9, got {bad!r}" in capsys.readouterr().err


def test_estimate_takes_this_machines_gpu_as_initialize_does(monkeypatch, capsys):
    """Without --gpu-mem on a machine with CUDA the estimate derives its sizes from the first GPU's memory, the
    budget initialize takes there: on an H200 the estimate without it put the parameter window of a 0.6B GPT with
    everything on NVMe at 0.17 GiB of device where initialize, given the card, kept all 1.1 GiB resident. On a
    machine without CUDA a GPU is made up for the test (its name and size only)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 << 30))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Made-up GPU")
    card = torch.cuda.get_device_properties(0).total_memory
    assert main(["estimate", "--params", "6e8", "--largest-param", "5e7"]) == 0
    out = capsys.readouterr().out
    assert f"this machine's {torch.cuda.get_device_name(0)}" in out
    assert table(estimate(6 * 10**8, largest_param=5 * 10**7, gpu_mem=card)) in out
    assert main(["estimate", "--params", "6e8", "--largest-param", "5e7", "--gpu-mem", "8GiB"]) == 0
    assert table(estimate(6 * 10**8, largest_param=5 * 10**7, gpu_mem=8 << 30)) in capsys.readouterr().out


def test_estimate_without_cuda_plans_for_this_machine(monkeypatch, capsys):
    """No CUDA and no --gpu-mem: the machine's own device, the CPU (no pinned staging), as initialize would run
    there (before, a GPU's staging was charged: 41-145% above what the engine measured)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["estimate", "--params", "6e8", "--largest-param", "5e7"]) == 0
    out = capsys.readouterr().out
    assert "planned for the CPU as the device (no CUDA here)" in out and "1 rank(s) on the CPU" in out
    assert table(estimate(6 * 10**8, largest_param=5 * 10**7, cuda=False)) in out
    assert "activations (--activations): not counted" in out and "(on the CPU, on top of host + device)" in out


def test_estimate_plans_with_a_configs_sizes_and_the_cpus_ram_once(tmp_path, capsys):
    """``--config``: the accumulation steps (whole fp32 gradients on the host: 5.4x the host bytes of a window
    without), precision, sizes and per-rank budgets a run would take, as planner.estimate takes them; flags win.
    On the CPU the device tier is RAM too: a placement fits only if device + host fit --host-mem (it answered yes
    for 1.53 GiB under 1.4 GiB), and --host-mem no longer sizes the device window (3.6x the measured); --device-mem
    is the CPU's device budget. Bad values name their flag; --json writes the table's numbers."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"gradient_accumulation_steps": 2, "bf16": {"enabled": True},
                               "zero_optimization": {"sub_group_size": 10**7},
                               "offload": {"device_memory_budget": "64MiB", "host_memory_budget": "3GiB"}}))
    out_json = tmp_path / "est.json"
    assert main(["estimate", "--params", "1e8", "--largest-param", "1e7", "--device", "cpu", "--config", str(cfg),
                 "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    want = estimate(10**8, largest_param=10**7, cuda=False, gradient_accumulation_steps=2, sub_group_size=10**7,
                    gpu_mem=64 << 20, host_mem=3 << 30)
    assert table(want) in out and "2 accumulation steps" in out and "held to 64.00 MiB" in out
    saved = json.loads(out_json.read_text())["estimates"]
    assert [(e["host_bytes"], e["fits"]) for e in saved] == [(e.host, e.fits) for e in want]
    without = {e.placement: e for e in estimate(10**8, largest_param=10**7, cuda=False)}
    assert {e.placement: e for e in want}["optimizer on nvme"].host > 4 * without["optimizer on nvme"].host
    assert main(["estimate", "--params", "1e8", "--largest-param", "1e7", "--config", str(cfg),
                 "--gradient-accumulation-steps", "1", "--device", "cpu"]) == 0
    assert "accumulation steps" not in capsys.readouterr().out  # the flag wins
    # device + host in one RAM: fits only if both do
    ests = {e.placement: e for e in estimate(10**8, largest_param=10**7, cuda=False)}
    e = ests["optimizer on cpu"]
    squeezed = {x.placement: x for x in estimate(10**8, largest_param=10**7, cuda=False,
                                                 host_mem=e.host + e.device // 2)}["optimizer on cpu"]
    assert (squeezed.fits, squeezed.limiting) == (False, "host")
    assert {x.placement: x for x in estimate(10**8, largest_param=10**7, cuda=False, host_mem=10 << 30)}[
        "optimizer + parameters on nvme"].device == ests["optimizer + parameters on nvme"].device
    for flags, message in ((["--buffer-count", "0"], "--buffer-count must be an integer in [1, 64], got '0'"),
                           (["--buffer-count", "-1"], "--buffer-count must be an integer in [1, 64], got '-1'"),
                           (["--gradient-clipping", "-1"], "--gradient-clipping must be 0 (off) or a positive"),
                           (["--sub-group-size", "nan"], "--sub-group-size must be a number of elements"),
                           (["--sub-group-size", "-5"], "--sub-group-size must be a number of elements"),
                           (["--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps must be a "
                                                                    "positive integer")):
        assert main(["estimate", "--params", "1e9", *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags
    # a transformers-style config ("auto" left to the plan), fp16 (every gradient held for the overflow check),
    # and its own device
    hf = tmp_path / "hf.json"
    hf.write_text(json.dumps({"fp16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
                              "gradient_accumulation_steps": "auto", "optimizer": {"type": "AdamW", "params": {
                                  "lr": "auto"}}, "scheduler": {"type": "WarmupDecayLR", "params": {
                                      "total_num_steps": "auto"}},
                              "zero_optimization": {"stage": 2, "sub_group_size": "auto"}}))
    assert main(["estimate", "--params", "1e8", "--largest-param", "1e7", "--config", str(hf)]) == 0
    out = capsys.readouterr().out  # precision "auto": neither fp16 nor bf16 known, fp32's bytes
    here = {"gpu_mem": torch.cuda.get_device_properties(0).total_memory} if torch.cuda.is_available() else \
        {"cuda": False}  # as the CLI plans: for this machine (on CUDA, the card's memory as the budget)
    assert table(estimate(10**8, largest_param=10**7, dtype_bytes=4, **here)) in out
    # said, and the config it suggests keeps that precision (it suggested bf16 under fp32's numbers)
    assert "--config's fp16.enabled are \"auto\" (OffloadTrainer fills them from the TrainingArguments): planned as " \
        "fp32" in out
    assert main(["estimate", "--params", "1e8", "--config", str(hf), "--host-mem", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "best: " in out and '"zero_optimization"' in out and "bf16" not in out and '"fp16"' not in out
    hf.write_text(json.dumps({"fp16": {"enabled": True}, "offload": {"device": "cpu"}}))
    assert main(["estimate", "--params", "1e8", "--largest-param", "1e7", "--config", str(hf)]) == 0
    out = capsys.readouterr().out
    assert "planned for the CPU as the device (the config's offload.device)" in out
    assert table(estimate(10**8, largest_param=10**7, cuda=False, fp16=True)) in out
    assert main(["estimate", "--params", "1e8", "--config", str(hf), "--host-mem", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "fp16 with fp32 Adam state" in out and '"fp16": {\n    "enabled": true' in out and "bf16" not in out
    assert main(["estimate", "--params", "1e20"]) == 2
    assert "--params must be a positive number of parameters such as 7e9, got '1e20'" in capsys.readouterr().err


def test_progress_bars_only_on_a_terminal(monkeypatch, capsys):
    from offload import _progress

    assert _progress.bar(3).disable  # pytest's stderr is no terminal: no bar, plain lines
    items = [1, 2]
    assert _progress.progress(items, "x") is items
    monkeypatch.setattr(_progress, "interactive", lambda: True)
    bar = _progress.bar(2, "work")
    assert not bar.disable
    bar.update(2)
    bar.close()
    assert list(_progress.progress(items, "x")) == items
    assert "work" in capsys.readouterr().err


def signalled_demo(tmp_path: Path, sig: int) -> tuple[int, str]:
    """Starts a long demo with its swap folder under ``tmp_path``, sends ``sig`` once it trains, and returns its exit
    status and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "offload", "demo", "--layers", "1", "--width", "64", "--steps",
                             "100000", "--swap-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("offload-demo-*/*/swap-*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(tmp_path.glob("offload-demo-*")), "the demo did not start"
        time.sleep(1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, err


def test_sigterm_ends_the_demo_through_its_cleanup(tmp_path):
    """A timeout or a scheduler's SIGTERM closes the engine and removes the demo's swap folder (285 MB was left
    behind before)."""
    code, err = signalled_demo(tmp_path, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert list(tmp_path.iterdir()) == []


README_ESTIMATE = ["estimate", "--params", "7e9", "--gpu-mem", "24GiB", "--host-mem", "64GiB", "--nvme-free", "1TB"]


def test_estimate_of_a_count_assumes_a_common_decoders_largest_parameter_and_says_so(tmp_path, capsys):
    """The README's command: a 7B model taken as one parameter charged the device for a gradient of all of it
    (26 GiB) and recommended the parameters on NVMe too; a 7B decoder's largest parameter is its embedding (0.5B
    elements), with which the optimizer on NVMe fits 24 GiB. What was assumed is printed, and flags change it:
    --largest-param, and --activations (charged to the device tier)."""
    largest = DecoderShape.typical(7 * 10**9).largest_param
    budgets = dict(gpu_mem=24 << 30, host_mem=64 << 30, nvme_free=10**12)
    assert main(README_ESTIMATE + ["--json", str(tmp_path / "est.json")]) == 0
    out = capsys.readouterr().out
    assert "best: optimizer on nvme\n" in out and table(estimate(7 * 10**9, largest_param=largest, **budgets)) in out
    assert f"assumed:\n  the largest parameter (--largest-param): {largest:,} elements (the embedding" in out
    assert "activations (--activations): not counted" in out
    saved = json.loads((tmp_path / "est.json").read_text())
    assert saved["largest_param"] == largest and saved["activations_bytes"] == 0
    assert main(README_ESTIMATE + ["--largest-param", "7e9"]) == 0  # the old assumption, given: it fits no more
    out = capsys.readouterr().out
    assert "best: optimizer + parameters on nvme\n" in out and "7,000,000,000 elements, as given" in out
    assert main(README_ESTIMATE + ["--activations", "12GiB"]) == 0
    out = capsys.readouterr().out
    with_activations = estimate(7 * 10**9, largest_param=largest, activations=12 << 30, **budgets)
    assert table(with_activations) in out and "best: optimizer + parameters on nvme\n" in out
    assert "activations (--activations): 12.00 GiB at their peak, in the device column" in out
    assert main(["estimate", "--model", "offload.models:GPT", "--gpu-mem", "1GiB", "--activations=-1GiB"]) == 2
    assert "--activations must be a byte count" in capsys.readouterr().err
    assert main(["estimate", "--model", "models:make", "--gpu-mem", "1GiB"]) == 0  # a model: its own, by name
    name, p = max(make().named_parameters(), key=lambda item: item[1].numel())
    assert f"the largest parameter: {p.numel():,} elements, the model's own ({name})" in capsys.readouterr().out


def test_a_memory_of_zero_is_none_of_it(capsys):
    """``--nvme-free 0`` (no NVMe here) and ``--host-mem 0`` are zero bytes: it answered "give a unit, e.g. 0GiB",
    and 0GiB was refused too. With no NVMe the 3B model that fits only with its optimizer on NVMe fits nowhere."""
    flags = ["estimate", "--params", "3e9", "--gpu-mem", "24GiB", "--host-mem", "24GiB"]
    assert main([*flags, "--nvme-free", "0"]) == 1
    out = capsys.readouterr().out
    assert "nothing fits" in out and out.count("no (nvme)") == 2, out
    assert main([*flags, "--nvme-free", "0GiB"]) == 1 and "nothing fits" in capsys.readouterr().out
    assert main(["estimate", "--params", "1e8", "--gpu-mem", "24GiB", "--host-mem", "0"]) == 0
    out = capsys.readouterr().out
    assert "best: no offload" in out and "optimizer on cpu" in out and "no (host)" in out


def test_ctrl_c_ends_a_command_with_one_line_and_status_130(tmp_path):
    """Ctrl-C (SIGINT) during the demo's training: the cleanup runs (the swap folder goes), then one line on stderr
    and the shell's status for it, 130; it printed a 20-line traceback."""
    code, err = signalled_demo(tmp_path, signal.SIGINT)
    assert code == 130, err[-2000:]
    assert "Traceback" not in err and err.splitlines()[-1] == "python -m offload demo: interrupted", err[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_a_demo_killed_outright_is_cleaned_up_by_the_next(tmp_path, caplog):
    """A SIGKILLed demo cannot remove its swap folder (300 MB at the default size, left in $TMPDIR for ever): the
    next demo in the same place removes it, as its owner is gone, and leaves nothing itself."""
    small = ["--layers", "1", "--width", "64", "--vocab", "128", "--swap-dir", str(tmp_path)]
    proc = subprocess.Popen([sys.executable, "-m", "offload", "demo", *small, "--steps", "100000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("offload-demo-*/*/swap-*/swap.0")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
        proc.kill()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    (left,) = tmp_path.glob("offload-demo-*")
    assert any(left.rglob("swap.0")), err[-2000:]
    assert main(["demo", *small, "--steps", "2"]) in (0, 1)  # (1: the loss did not fall in two steps)
    assert list(tmp_path.iterdir()) == []
    assert f"removed {left}" in caplog.text
