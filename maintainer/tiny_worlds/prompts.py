"""Write the tiny world's prompt files from the world itself (grpo/tiny/world.py `prompt_files`), so the .txt and the
.jsonl (prompts with their scene metadata, for the tiny_world_meta reward) never drift from the split or the parser;
and its edit set (`edit_files`: tiny_edit_{train,heldout}.jsonl and their 64 px source images in tiny_edit/, for the
FLUX.1-Kontext presets, recipes/configs/tiny_kontext/).

    python -m maintainer.tiny_worlds.prompts [FOLDER]      # default assets/prompts
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpo.tiny import world


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0] if argv else Path(__file__).resolve().parents[2] / "assets" / "prompts")
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in world.prompt_files().items():
        (folder / name).write_text(text, encoding="utf-8")
        print(folder / name)
    for name, data in world.edit_files().items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    print(folder / "tiny_edit_train.jsonl", folder / "tiny_edit_heldout.jsonl", folder / world.EDIT_DIR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
