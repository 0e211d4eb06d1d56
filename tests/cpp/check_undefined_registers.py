"""Fails if a graphsafe CUDA kernel's PTX reads a register that nothing writes.

Such a read comes from uninitialised data in the source (a state slot an algorithm does not use, say). The
compiler may then hoist work on that garbage to the top of a kernel, and the branch it takes can split a
warp on whatever an earlier kernel left in the register: this is how LARS fp32 once lost updates on the H200.
compute-sanitizer does not see uninitialised registers, so this static check guards against it.

Usage: check_undefined_registers.py NVCC INCLUDE_DIR SRC_DIR FILE.cu [FILE.cu ...]
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path


def undefined_reads(ptx: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for match in re.finditer(r"\.entry\s+(\S+)\((.*?)\n\}\n", ptx, re.S):
        name, body = match.group(1), match.group(2)
        if "graphsafe" not in name or "cub" in name:  # CUB's own kernels are not ours to check
            continue
        defined: set[str] = set()
        used: dict[str, str] = {}
        for line in body.split("\n"):
            line = line.strip().lstrip("{").rstrip("}").strip()
            if not line or line.startswith(("//", ".")) or line.endswith(":"):
                continue
            line = re.sub(r"^@!?%p\d+\s+", "", line)
            parts = line.rstrip(";").split(None, 1)
            if len(parts) < 2:
                continue
            op, args = parts
            if op.startswith(("st.", "bar", "ret", "bra", "red.")):
                for reg in re.findall(r"%[a-z]+\d+", args):
                    used.setdefault(reg, line)
                continue
            dest = re.match(r"\s*(\{[^}]*\}|%[a-z]+\d+(\|%p\d+)?)", args)
            rest = args
            if dest:
                defined.update(re.findall(r"%[a-z]+\d+", dest.group(1)))
                rest = args[dest.end():]
            for reg in re.findall(r"%[a-z]+\d+", rest):
                used.setdefault(reg, line)
        bad = [f"{reg}: {line}" for reg, line in used.items() if reg not in defined]
        if bad:
            found[name] = bad
    return found


def main() -> int:
    nvcc, include_dir, src_dir, *sources = sys.argv[1:]
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for source in sources:
            ptx_path = Path(tmp) / (Path(source).stem + ".ptx")
            subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-O3", "--fmad=false", f"-I{include_dir}",
                            f"-I{src_dir}", "-ptx", source, "-o", str(ptx_path)], check=True)
            for kernel, reads in undefined_reads(ptx_path.read_text()).items():
                failures += 1
                print(f"{source}: {kernel} reads {len(reads)} undefined register(s), e.g. {reads[0]}")
    print("no undefined register reads" if failures == 0 else f"{failures} kernel(s) read undefined registers")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
