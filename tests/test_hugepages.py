"""pagedllm/_hugepages.py: torch's large CPU allocations on transparent huge pages, chosen at
import where the kernel gives them on request; PAGEDLLM_THP=0 and a user's own setting win."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import _hugepages


def test_thp_mode_reads_the_bracketed_word(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    for text, want in [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                       ("always madvise [never]", "never"), ("garbage", None)]:
        f.write_text(text)
        assert _hugepages.thp_mode(str(f)) == want
    assert _hugepages.thp_mode(str(tmp_path / "missing")) is None


def test_choose() -> None:
    assert _hugepages.choose("auto", "madvise", None)[0]
    assert _hugepages.choose("auto", "always", None)[0]
    assert not _hugepages.choose("auto", "never", None)[0]
    assert not _hugepages.choose("auto", None, None)[0]
    assert not _hugepages.choose("0", "madvise", None)[0]
    on, why = _hugepages.choose("auto", "madvise", "0")
    assert not on and "set by the user" in why
    with pytest.raises(ValueError, match="PAGEDLLM_THP='yes please'"):
        _hugepages.choose("yes please", "madvise", None)


def _after_import(**env: str) -> tuple[str, int]:
    """THP_MEM_ALLOC_ENABLE after ``import pagedllm``, and the KiB of huge pages the process
    holds once torch allocated (and zeroed) a 64 MiB tensor."""
    base = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "PAGEDLLM_THP")}
    code = ("import os, pagedllm, torch; x = torch.zeros(1 << 24); "
            "kb = [l.split()[1] for l in open('/proc/self/smaps_rollup') "
            "if l.startswith('AnonHugePages')]; "
            "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), kb[0] if kb else -1)")
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0], int(out[1])


def test_import_turns_it_on_where_the_kernel_allows_and_leaves_the_users_alone() -> None:
    mode = _hugepages.thp_mode()
    var, kb = _after_import()
    assert var == ("1" if mode in ("madvise", "always") else "None")
    off_var, off_kb = _after_import(PAGEDLLM_THP="0")
    assert off_var == "None"
    assert _after_import(THP_MEM_ALLOC_ENABLE="0")[0] == "0"
    if mode == "madvise" and kb >= 0:  # only what torch asks for is on huge pages
        assert off_kb == 0
        assert kb >= 2048, "torch's 64 MiB tensor got no huge page"
