"""Hugging Face folders from strangers: checked before transformers reads them.

transformers runs Python files shipped in a folder whose ``config.json`` or
``tokenizer_config.json`` has an ``auto_map`` (after a ``[y/N]`` prompt, or at once with
``trust_remote_code=True``), and follows whatever files and symlinks the folder holds. So every
folder handed to ``from_pretrained`` first passes :func:`check_hf_folder`: no ``auto_map``, every
entry a regular file or folder that resolves inside it, and (for model folders) weights our
strict reader accepts. Callers also pass ``trust_remote_code=False`` (:data:`NO_REMOTE_CODE`).
"""

from __future__ import annotations

from pathlib import Path

from mergekit_loco.io.files import UnsafeInputError, inside, read_json, shown

#: Keyword arguments for every ``from_pretrained`` call: local files only, never run code.
NO_REMOTE_CODE = {"local_files_only": True, "trust_remote_code": False}
#: JSON files in which transformers looks for ``auto_map`` (custom code to import).
CODE_BEARING_FILES = ("config.json", "tokenizer_config.json", "processor_config.json",
                      "preprocessor_config.json", "generation_config.json")  # fmt: skip
#: How deep below the folder entries are checked (transformers reads e.g.
#: ``additional_chat_templates/*.jinja`` one level down).
CHECK_DEPTH = 2


def check_hf_folder(folder: str | Path, what: str, weights: bool = False) -> Path:
    """``folder`` if transformers may read it; raises :class:`UnsafeInputError` naming the file.

    Refused: not a folder; an entry (to depth :data:`CHECK_DEPTH`) that is a symlink leading
    outside, a FIFO, device or socket; a config with ``auto_map`` (custom code) or that is not a
    JSON object; with ``weights``, a checkpoint our reader refuses (e.g. an index naming
    ``../x``).
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise UnsafeInputError(f"{what} {shown(folder)}: no such folder")
    check_entries(folder, folder, CHECK_DEPTH)
    for name in CODE_BEARING_FILES:
        if not (folder / name).exists():
            continue
        settings = read_json(folder / name, name)
        if not isinstance(settings, dict):
            raise UnsafeInputError(f"{shown(folder / name)}: not a JSON object")
        refuse_custom_code(folder / name, settings)
    if weights:
        from mergekit_loco.io.reader import CheckpointError, open_checkpoint

        try:
            open_checkpoint(folder).close()
        except CheckpointError as error:
            raise UnsafeInputError(str(error)) from None
    return folder


def check_entries(root: Path, folder: Path, depth: int) -> None:
    """Every entry of ``folder`` (recursively to ``depth``) is a regular file or folder inside
    ``root``."""
    for entry in sorted(folder.iterdir()):
        path = inside(root, str(entry.relative_to(root)), "file")
        if path.is_dir():
            if depth > 1:
                check_entries(root, path, depth - 1)
        elif not path.is_file():
            raise UnsafeInputError(f"{shown(path)}: not a regular file; refused")


def refuse_custom_code(path: Path, settings: dict) -> None:
    """Raise :class:`UnsafeInputError` if the config ``settings`` read from ``path`` asks
    transformers to import code shipped beside it (``auto_map``)."""
    if "auto_map" in settings:
        raise UnsafeInputError(
            f"{shown(path)}: asks to run custom Python code (auto_map); refused: mergekit_loco "
            "never runs code from a checkpoint or tokenizer folder"
        )
