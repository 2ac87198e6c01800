"""`kernel show RUN_ID --html FILE`: a killed loop's timeline, rendered in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOOP = ROOT / "examples" / "stuck-deploy.yaml"


def chromium() -> str:
    """The headless browser (Debian package `chromium`); CI=true fails rather than skips."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed (.ci/run installs it with apt)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


def browse(exe: str, page: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp / "profile"
    return subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--no-first-run", f"--user-data-dir={profile}", *args, page.as_uri()],
        capture_output=True, text=True, timeout=180, env={**os.environ, "HOME": str(tmp)})


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    height = channels = 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
            assert depth == 8 and interlace == 0 and colour in (2, 6)
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 255
        rows.append(bytes(line[k] for k in range(stride) if channels == 3 or k % 4 != 3))
        prev = line
    return width, height, rows


@pytest.fixture(scope="module")
def killed_loop(tmp_path_factory: pytest.TempPathFactory, kernel_exe: str) -> tuple[str, Path]:
    """A loop that builds, tests, then hangs: nudged, then killed `stalled` (run id, db)."""
    tmp = tmp_path_factory.mktemp("loop")
    db = tmp / "k.duckdb"
    env = {**os.environ, "KERNEL_DB": str(db), "NO_COLOR": "1"}
    proc = subprocess.run([kernel_exe, "run", "--json", "--idle-timeout", "1", str(LOOP)],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=180)
    result = json.loads(proc.stdout)
    assert result["status"] == "killed" and result["reason"] == "stalled", proc.stderr
    return result["run_id"], db


@pytest.mark.realtime
class TestTimelineHTML:
    def test_the_page_is_self_contained(self, killed_loop: tuple[str, Path], kernel_exe: str,
                                        tmp_path: Path) -> None:
        """One private file with inline CSS/JS/SVG: nothing is fetched from anywhere."""
        run_id, db = killed_loop
        page = tmp_path / "t.html"
        proc = subprocess.run([kernel_exe, "show", run_id[:10], "--db", str(db), "--html",
                               str(page)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert run_id in proc.stdout  # the text timeline is still printed
        assert stat.S_IMODE(page.stat().st_mode) == 0o600
        html = page.read_text()
        assert "<style>" in html and "<script>" in html and "<svg" in html
        assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\(", html)
        # the only URLs are SVG's namespace name, which is never fetched
        assert set(re.findall(r"https?://[^\"' ]+", html)) <= {"http://www.w3.org/2000/svg"}
        proc = subprocess.run([kernel_exe, "show", run_id, "--db", str(db), "--html",
                               str(tmp_path / "missing" / "t.html")],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert "--html: cannot write" in proc.stderr

    def test_chromium_renders_the_killed_loop(self, killed_loop: tuple[str, Path],
                                              kernel_exe: str, tmp_path: Path) -> None:
        """Headless Chromium: the DOM has lanes, bars, the nudge and the kill; the picture is
        not blank and shows the kill marker's red."""
        exe = chromium()
        run_id, db = killed_loop
        page = tmp_path / "t.html"
        subprocess.run([kernel_exe, "show", run_id, "--db", str(db), "--html", str(page)],
                       check=True, capture_output=True, timeout=120)

        dom = browse(exe, page, tmp_path, "--dump-dom")
        assert dom.returncode == 0, dom.stderr
        html = dom.stdout
        assert 'id="timeline"' in html and 'id="output-rate"' in html and 'id="usage"' in html
        states = re.findall(r'class="bar state"[^>]*data-detail="states: (\w+)', html)
        assert states == ["build", "test", "deploy"]
        assert html.count('class="bar step"') == 2
        assert html.count('class="bar action"') == 2
        assert html.count('class="bar action unfinished"') == 1  # deploy, killed mid-action
        assert html.count('class="marker critic-nudge"') == 1
        assert html.count('class="marker critic-kill"') == 1
        assert ">kill: stalled</text>" in html
        assert html.count('class="rate"') == 60
        assert 'class="usage usage-steps"' in html
        assert "killed" in html

        shot = tmp_path / "t.png"
        proc = browse(exe, page, tmp_path, "--window-size=1140,620", f"--screenshot={shot}")
        assert proc.returncode == 0 and shot.exists(), proc.stderr
        width, height, rows = png_pixels(shot)
        assert (width, height) == (1140, 620)
        pixels = [row[i:i + 3] for row in rows for i in range(0, len(row), 3)]
        white = sum(1 for p in pixels if p == b"\xff\xff\xff")
        assert white < 0.92 * len(pixels)  # not blank
        assert len(set(pixels)) > 20
        kill_red = sum(1 for p in pixels if abs(p[0] - 0xD6) < 12 and abs(p[1] - 0x27) < 12
                       and abs(p[2] - 0x28) < 12)
        assert kill_red > 50  # the kill marker's line and label


@pytest.mark.realtime
class TestReport:
    def test_chromium_renders_a_time_range(self, killed_loop: tuple[str, Path],
                                           kernel_exe: str, tmp_path: Path) -> None:
        """`kernel report`: one page for the runs of a range, an overview bar per run
        (coloured by status, the kill marked) and each run's timeline, rendered in Chromium."""
        exe = chromium()
        run_id, db = killed_loop
        env = {**os.environ, "KERNEL_DB": str(db), "NO_COLOR": "1"}
        ids = [run_id]
        for cmd in (["true"], ["false"]):
            proc = subprocess.run([kernel_exe, "run", "--json", "--", *cmd], env=env,
                                  capture_output=True, text=True, timeout=120, cwd=tmp_path)
            ids.append(json.loads(proc.stdout)["run_id"])
        page = tmp_path / "report.html"
        proc = subprocess.run([kernel_exe, "report", str(page), "--since", "1h", "--db", str(db)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.strip() == f"wrote {page} (3 of 3 run(s))"
        assert stat.S_IMODE(page.stat().st_mode) == 0o600
        html = page.read_text()
        assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\(", html)

        dom = browse(exe, page, tmp_path, "--dump-dom")
        assert dom.returncode == 0, dom.stderr
        html = dom.stdout
        assert 'id="overview"' in html
        bars = re.findall(r'class="bar run-bar status-(\w+)" data-run="(\w+)"', html)
        assert bars == [("killed", ids[0]), ("ok", ids[1]), ("error", ids[2])]  # oldest first
        for rid in ids:
            assert f'id="run-{rid}"' in html and f'id="timeline-{rid}"' in html
        assert html.count('class="marker critic-kill"') == 2  # overview + the loop's timeline
        assert "3 run(s): " in html

        shot = tmp_path / "report.png"
        proc = browse(exe, page, tmp_path, "--window-size=1140,620", f"--screenshot={shot}")
        assert proc.returncode == 0 and shot.exists(), proc.stderr
        width, height, rows = png_pixels(shot)
        assert (width, height) == (1140, 620)
        pixels = [row[i:i + 3] for row in rows for i in range(0, len(row), 3)]
        assert sum(1 for p in pixels if p == b"\xff\xff\xff") < 0.95 * len(pixels)
        ok_green = sum(1 for p in pixels if abs(p[0] - 0x59) < 12 and abs(p[1] - 0xA1) < 12
                       and abs(p[2] - 0x4F) < 12)
        assert ok_green > 20  # the ok run's bar

    def test_bad_ranges_are_one_line(self, killed_loop: tuple[str, Path], kernel_exe: str,
                                     tmp_path: Path) -> None:
        """An empty range or an unwritable file: one line, exit 2 / exit 1; an old range: 0 runs."""
        _, db = killed_loop
        page = tmp_path / "r.html"
        proc = subprocess.run([kernel_exe, "report", str(page), "--since", "1h", "--until", "2h",
                               "--db", str(db)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "--until must be more recent than --since" in proc.stderr
        proc = subprocess.run([kernel_exe, "report", str(tmp_path / "no" / "r.html"),
                               "--db", str(db)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert "cannot write" in proc.stderr
        proc = subprocess.run([kernel_exe, "report", str(page), "--since", "2w", "--until", "1w",
                               "--db", str(db), "--json"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert (doc["file"], doc["runs"], doc["total"]) == (str(page), [], 0)
        assert "0 run(s)" in page.read_text()


class TestReportOfABatch:
    def test_a_batch_is_its_runs(self, kernel_exe: str, cli_env: dict[str, str],
                                 tmp_path: Path) -> None:
        """`kernel report --batch ID`: the page holds exactly that batch's runs (an id prefix
        works), headed by the batch; runs outside it are left out."""
        subprocess.run([kernel_exe, "run", "--", "true"], env=cli_env, check=True,
                       capture_output=True, timeout=120)  # a run of no batch
        tasks = tmp_path / "t.jsonl"
        tasks.write_text("\n".join(json.dumps(t) for t in [
            {"id": "a", "command": ["true"]}, {"id": "b", "command": ["false"]}]) + "\n")
        proc = subprocess.run([kernel_exe, "batch", str(tasks), "--json"], env=cli_env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr  # one task failed
        docs = [json.loads(line) for line in proc.stdout.splitlines()]
        batch_id = docs[0]["batch_id"]
        page = tmp_path / "batch.html"
        proc = subprocess.run([kernel_exe, "report", str(page), "--batch", batch_id[:6],
                               "--json"], env=cli_env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["batch"] == batch_id and doc["total"] == 2
        assert sorted(doc["runs"]) == sorted(d["run_id"] for d in docs)
        html = page.read_text()
        assert f"<h1>batch {batch_id}: runs " in html
        bars = re.findall(r'class="bar run-bar status-(\w+)" data-run="(\w+)"', html)
        assert sorted(bars) == sorted((d["status"], d["run_id"]) for d in docs)

    def test_bad_batch_requests_are_one_line(self, kernel_exe: str, cli_env: dict[str, str],
                                             tmp_path: Path) -> None:
        """An unknown batch, or --batch with a time range: one line, exit 2."""
        subprocess.run([kernel_exe, "run", "--", "true"], env=cli_env, check=True,
                       capture_output=True, timeout=120)
        page = tmp_path / "r.html"
        for extra, says in ((["--batch", "ffffffff"], "no batch 'ffffffff'"),
                            (["--batch", "ab", "--since", "1h"], "--batch takes no --since")):
            proc = subprocess.run([kernel_exe, "report", str(page), *extra], env=cli_env,
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
            assert says in proc.stderr
            assert not page.exists()
