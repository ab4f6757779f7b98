"""The systemd unit: required directives, `systemd-analyze verify`, the exposure the README states,
and that the sandbox leaves the supervisor what it needs (every syscall a real run makes, traced
with strace; psutil reads of its children's /proc).

`systemd-analyze` runs offline (no systemd as PID 1 needed); tests that need it, or root for a
mount namespace, skip with the reason where it is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from harness import publish, wait_until

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "jetstream-supervisor.service"
TEMPLATE = UNIT.parent / "jetstream-supervisor@.service"      # one instance per pool (issue 28)
README = UNIT.parent.parent / "README.md"
DEFAULT_GRACEFUL_TIMEOUT = 30.0  # docs/CONTRACT.md: workers.graceful_timeout


def readme_exposure() -> float:
    """The figure the README promises: "`systemd-analyze security --offline=yes` rates it **1.2**"."""
    m = re.search(r"`systemd-analyze security --offline=yes` rates it \*\*(\d+(?:\.\d+)?)\*\*", README.read_text())
    assert m, "the README no longer states the unit's exposure in the expected words"
    return float(m.group(1))


# ------------------------------------------------------------------------------- unit parsing

def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """Sections -> [(key, value)] in order; repeated keys kept (systemd accumulates many)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"assignment outside a section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not an assignment: {raw!r}"
        current.append((key.strip(), value.strip()))
    return sections


def values(unit, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def value(unit, section: str, key: str) -> str:
    found = values(unit, section, key)
    assert found, f"[{section}] {key}= missing"
    return found[-1]


_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600}


def timespan(text: str) -> float:
    """systemd time span in seconds: '75', '75s', '1min 15s', '1m15s'."""
    if re.fullmatch(r"\d+(\.\d+)?", text.strip()):
        return float(text)
    total, pos = 0.0, 0
    for m in re.finditer(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)", text):
        assert m.start() == pos and m.group(2) in _UNITS, f"cannot parse time span {text!r}"
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    assert pos == len(text) and pos, f"cannot parse time span {text!r}"
    return total


@pytest.fixture(scope="module")
def unit():
    return parse_unit(UNIT.read_text())


def test_timespan_parser():
    assert timespan("75") == 75 and timespan("75s") == 75 and timespan("1min 15s") == 75
    assert timespan("1m15s") == 75 and timespan("500ms") == 0.5


# ---------------------------------------------------------------------- required directives

def test_lifecycle_directives(unit):
    assert value(unit, "Service", "Type") == "notify"
    assert value(unit, "Service", "NotifyAccess") == "main"
    assert value(unit, "Service", "KillMode") == "mixed"
    assert re.fullmatch(r"/(usr/)?bin/kill -HUP \$MAINPID", value(unit, "Service", "ExecReload"))
    exec_start = value(unit, "Service", "ExecStart").split()
    assert exec_start[0] == "/opt/jetstream-supervisor/bin/supervisor"
    assert exec_start[1:] == ["start", "--config", "/etc/jetstream-supervisor/config.toml"]


def test_timeouts(unit):
    stop = timespan(value(unit, "Service", "TimeoutStopSec"))
    assert stop > DEFAULT_GRACEFUL_TIMEOUT
    assert stop >= DEFAULT_GRACEFUL_TIMEOUT + 15, "leave room for NAK/flush and nats-server exit"
    assert timespan(value(unit, "Service", "WatchdogSec")) == 30


def test_restart_policy(unit):
    assert value(unit, "Service", "Restart") == "on-failure"
    assert timespan(value(unit, "Service", "RestartSec")) > 0
    assert set(value(unit, "Service", "RestartPreventExitStatus").split()) == {"2", "3"}
    assert int(value(unit, "Unit", "StartLimitBurst")) > 0
    assert timespan(value(unit, "Unit", "StartLimitIntervalSec")) > 0
    # A worker OOM-killed is the supervisor's to handle, not a reason to stop the service.
    assert value(unit, "Service", "OOMPolicy") == "continue"


def test_identity_and_state(unit):
    assert value(unit, "Service", "DynamicUser") == "yes"
    assert value(unit, "Service", "StateDirectory") == "jetstream-supervisor"
    assert value(unit, "Service", "ConfigurationDirectory") == "jetstream-supervisor"
    env = " ".join(values(unit, "Service", "Environment"))
    assert re.search(r"\bSUPERVISOR_EMBEDDED_STORE_DIR=(%S|/var/lib)/jetstream-supervisor\b", env)
    assert value(unit, "Service", "UMask") == "0077"


def test_sandbox_directives(unit):
    expected = {
        "NoNewPrivileges": "yes", "CapabilityBoundingSet": "", "AmbientCapabilities": "",
        "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
        "PrivateDevices": "yes", "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
        "ProtectKernelLogs": "yes", "ProtectControlGroups": "yes", "ProtectClock": "yes",
        "ProtectHostname": "yes", "ProtectProc": "invisible", "ProcSubset": "pid",
        "RestrictNamespaces": "yes", "RestrictRealtime": "yes", "RestrictSUIDSGID": "yes",
        "LockPersonality": "yes", "MemoryDenyWriteExecute": "yes",
        "SystemCallArchitectures": "native",
    }
    for key, want in expected.items():
        assert value(unit, "Service", key) == want, key
    families = set(value(unit, "Service", "RestrictAddressFamilies").split())
    assert families == {"AF_UNIX", "AF_INET", "AF_INET6"}


# ------------------------------------------------------------------------- systemd-analyze

def analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    return path


def runnable_copy(tmp_path: Path, unit: Path = UNIT, name: str | None = None) -> Path:
    """The unit (or `name`, an instance of a template) with ExecStart pointing at a binary that exists here.

    `verify` checks that ExecStart= is executable and /opt/jetstream-supervisor is not installed
    on a development machine, so the copy runs this venv's `supervisor` script when it is
    installed, else /bin/true; every other line is the unit's own.
    """
    installed = Path(sys.prefix) / "bin" / "supervisor"
    binary = installed if os.access(installed, os.X_OK) else Path("/bin/true")
    text = unit.read_text()
    rewritten = re.sub(r"(?m)^ExecStart=\S+", f"ExecStart={binary}", text, count=1)
    assert rewritten != text
    copy = tmp_path / (name or unit.name)
    copy.write_text(rewritten)
    return copy


def test_systemd_analyze_verify(tmp_path):
    tool = analyze()
    copy = runnable_copy(tmp_path)
    proc = subprocess.run([tool, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    # verify exits 0 on unknown keys and unparsable values, printing "file:line: ..." warnings,
    # so any line about our unit is a failure.
    ours = [line for line in output.splitlines() if UNIT.name in line or str(copy) in line]
    assert proc.returncode == 0, output
    assert ours == [], "\n".join(ours)


def test_verify_flags_the_missing_binary_without_the_rewrite():
    """Why the test above rewrites ExecStart: on a dev machine the real path does not exist."""
    tool = analyze()
    if os.path.exists("/opt/jetstream-supervisor/bin/supervisor"):
        pytest.skip("the supervisor is installed in /opt/jetstream-supervisor on this machine")
    proc = subprocess.run([tool, "verify", str(UNIT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "/opt/jetstream-supervisor/bin/supervisor" in proc.stdout + proc.stderr


def test_security_exposure_is_what_the_readme_says():
    tool = analyze()
    proc = subprocess.run([tool, "security", "--offline=yes", str(UNIT)],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 and "offline" in proc.stderr:
        pytest.skip(f"systemd-analyze too old for --offline (needs systemd >= 250): {proc.stderr}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?) (\w+)", proc.stdout)
    assert m, proc.stdout
    assert (float(m.group(1)), m.group(2)) == (readme_exposure(), "OK"), proc.stdout[-2000:]


def syscall_groups(tool: str) -> dict[str, set[str]]:
    out = subprocess.run([tool, "syscall-filter"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    groups: dict[str, set[str]] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), set())
        elif line.startswith((" ", "\t")) and current is not None:
            item = line.strip()
            if item and not item.startswith("#"):
                current.add(item)
        elif line.strip():
            current = None  # trailing comment blocks (unlisted calls)
    return groups


def expand(names: list[str], groups: dict[str, set[str]]) -> set[str]:
    out: set[str] = set()
    stack = list(names)
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name.startswith("@"):
            if name not in seen:
                seen.add(name)
                stack.extend(groups[name])
        else:
            out.add(name)
    return out


def effective_allow_list(filters: list[str], groups: dict[str, set[str]]) -> set[str]:
    """systemd semantics: the first non-~ line makes it an allow list; ~ lines then remove."""
    assert filters and not filters[0].startswith("~"), "expected an allow list first"
    allowed: set[str] = set()
    for line in filters:
        if line.startswith("~"):
            allowed -= expand(line[1:].split(), groups)
        else:
            allowed |= expand(line.split(), groups)
    return allowed


def traced_syscalls(supervisor_factory, tmp_path) -> set[str]:
    """Every syscall name a real run makes, under `strace -f -c`: the supervisor, its embedded
    nats-server and its workers, through what the unit will see: start, jobs (a crash among
    them), /status /metrics /healthz (psutil RSS reads), SIGHUP, SIGTTIN, SIGTTOU, a recycle by
    max_jobs, SIGTERM."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (apt-get install strace): cannot derive the syscalls used")
    counts = tmp_path / "syscalls.txt"
    sup = supervisor_factory(None, start=False, workers={"count": 2, "max_jobs": 4, "max_rss_mb": 500},
                             embedded={"store_dir": str(tmp_path / "store")})
    sup.wrapper = (strace, "-f", "-qq", "-c", "-o", str(counts))
    sup.start()
    status = sup.wait_ready(2)
    pid = status["pid"]                          # the supervisor, under strace
    publish(status["nats"]["servers"][0], count=10, data="0.05")
    publish(status["nats"]["servers"][0], count=1, data="crash-once")
    wait_until(lambda: sup.status()["jobs"]["ack"] >= 11, what="the jobs done")
    for path in ("/status", "/metrics", "/healthz"):
        assert sup.get(path)[0] == 200
    for sig, workers in ((signal.SIGHUP, 2), (signal.SIGTTIN, 3), (signal.SIGTTOU, 2)):
        os.kill(pid, sig)
        sup.wait_ready(workers)
    os.kill(pid, signal.SIGTERM)
    assert sup.wait() == 0, sup.log()[-2000:]
    table = counts.read_text().splitlines()
    rule = next(i for i, line in enumerate(table) if line.startswith("------"))
    names = {line.split()[-1] for line in table[rule + 1:] if line.strip() and not line.startswith("------")}
    return names - {"total"}


def test_syscall_filter_allows_every_syscall_a_real_run_makes(unit, supervisor_factory, tmp_path):
    tool = analyze()
    groups = syscall_groups(tool)
    allowed = effective_allow_list(values(unit, "Service", "SystemCallFilter"), groups)
    used = traced_syscalls(supervisor_factory, tmp_path)
    assert {"clone", "execve", "pidfd_open", "epoll_pwait", "futex"} <= used, f"the trace looks incomplete: {used}"
    missing = sorted(used - allowed)
    assert missing == [], f"SystemCallFilter denies syscalls the supervisor uses: {missing}"
    # and it does deny what it claims to
    for denied in ("setrlimit", "setpriority", "setuid", "chown", "mount", "reboot", "ptrace"):
        assert denied not in allowed, denied


# ----------------------------------------------- ProtectProc=invisible + ProcSubset=pid

PSUTIL_PROBE = textwrap.dedent("""
    import os, signal, psutil
    assert not os.path.exists("/proc/stat"), "/proc is not mounted with subset=pid"
    pid = os.fork()
    if pid == 0:
        signal.pause()
        os._exit(0)
    try:
        p = psutil.Process(pid)
        rss = p.memory_info().rss
        uss = p.memory_full_info().uss
        assert rss > 0 and uss > 0, (rss, uss)
        print("PSUTIL-OK", rss, uss)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
""")


def test_psutil_reads_child_memory_under_procsubset_pid():
    """The unit's /proc (hidepid=invisible, subset=pid) still gives RSS of our own children."""
    pytest.importorskip("psutil")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a private /proc")
    drop = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"] if shutil.which("setpriv") else []
    setup = ("mount --make-rprivate / && "
             "mount -t proc -o hidepid=invisible,subset=pid proc /proc && "
             "echo SANDBOX-UP && exec \"$@\"")
    cmd = ["unshare", "--mount", "--", "sh", "-c", setup, "sh", *drop,
           sys.executable, "-c", PSUTIL_PROBE]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if "SANDBOX-UP" not in proc.stdout:
        pytest.skip(f"cannot build a private /proc here: {proc.stderr.strip()}")
    assert proc.returncode == 0 and "PSUTIL-OK" in proc.stdout, proc.stdout + proc.stderr


# ------------------------------------------------------------------- one unit per pool

PER_INSTANCE = {"Description", "ExecStart", "SyslogIdentifier", "StateDirectory", "Environment"}


def test_the_per_pool_template_is_the_unit_for_one_pool():
    """Every directive of the template is the unit's, but the few that make an instance one pool's."""
    unit, template = parse_unit(UNIT.read_text()), parse_unit(TEMPLATE.read_text())
    assert unit.keys() == template.keys()
    for section in unit:
        assert [kv for kv in template[section] if kv[0] not in PER_INSTANCE] == \
            [kv for kv in unit[section] if kv[0] not in PER_INSTANCE], section
    exec_start = value(template, "Service", "ExecStart").split()
    assert exec_start[1:] == ["start", "--config", "/etc/jetstream-supervisor/config.toml", "--pool", "%i"]
    env = values(template, "Service", "Environment")
    assert {"SUPERVISOR_MONITOR_HTTP=127.0.0.1:0", "SUPERVISOR_FLEET_NAME=%H-%i",
            "SUPERVISOR_EMBEDDED_STORE_DIR=%S/jetstream-supervisor-%i"} <= set(env)
    assert value(template, "Service", "StateDirectory") == "jetstream-supervisor-%i"


def test_an_instance_verifies_and_has_the_unit_s_exposure(tmp_path):
    tool = analyze()
    copy = runnable_copy(tmp_path, TEMPLATE, "jetstream-supervisor@email.service")
    proc = subprocess.run([tool, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and [line for line in output.splitlines() if copy.name in line] == [], output
    proc = subprocess.run([tool, "security", "--offline=yes", str(copy)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 and "offline" in proc.stderr:
        pytest.skip(f"systemd-analyze too old for --offline (needs systemd >= 250): {proc.stderr}")
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?) (\w+)", proc.stdout)
    assert m and (float(m.group(1)), m.group(2)) == (readme_exposure(), "OK"), proc.stdout[-2000:]
