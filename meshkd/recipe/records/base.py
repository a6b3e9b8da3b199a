"""What a row format is, and the registry of them by name (`dataset.records`).

A row format is how a dataset row (a JSONL object, a Hugging Face dataset row) holds a document. Each is one
`RowFormat` subclass in a module of this package, registered once under the name `dataset.records` gives it
(`@register`); everything that varies with the format asks the registry:

    reader(dataset, tokenizer, key)  a row -> its `Document` (the text, and the answers' spans when it marks them)
    settings_keys                    the `dataset` keys its documents depend on (the teacher cache's and the
                                     token store's keys record them)
    rendered                         a tokenizer's chat template writes the rows: each side renders its own
                                     (the teacher's with `kd.cross_tokenizer`), and the keys record the templates
    marks_answers                    its documents mark the answers (answer-only loss) and the prompt before
                                     the last one (the on-policy prompts)
    plain_text_files                 a plain text file is one row of it

Adding a format is one module here (imported by `meshkd/recipe/records/__init__.py`) and its test; a format
that reads a column no key names yet adds that key to `DatasetConfig` too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from meshkd.core.registry import Registry

if TYPE_CHECKING:
    from meshkd.recipe.records.document import Document

RowReader = Callable[[dict, str], "Document | None"]
"""`(row, where) -> Document` (None: an empty row, skipped); `where` names the row in errors (`file:line`)."""


class RowFormat:
    """One way a row holds a document. Subclasses set the class attributes and implement `reader`."""

    name: ClassVar[str]
    """The value of `dataset.records` that chooses it."""
    settings_keys: ClassVar[tuple[str, ...]] = ()
    """The `dataset` keys (without the prefix) its documents depend on."""
    rendered: ClassVar[bool] = False
    """Whether the tokenizer that reads a row writes its text (a chat template)."""
    marks_answers: ClassVar[bool] = False
    """Whether its documents mark their answers and the prompt before the last one."""
    plain_text_files: ClassVar[bool] = False
    """Whether a plain text file (not rows of JSONL, parquet, ...) is one row of this format."""

    def reader(self, dataset: Any, tokenizer: Any = None, tokenizer_key: str = "model.tokenizer") -> RowReader:
        """The reader of rows as the `dataset` section says, rendered (`rendered` formats) by `tokenizer`, which
        `tokenizer_key` names in errors. ValueError when the rows need what `tokenizer` does not have."""
        raise NotImplementedError


FORMATS: Registry[RowFormat] = Registry("row format", "dataset.records must be one of {known}, got {name}")
"""Every registered row format, by name (filled as `meshkd.recipe.records` imports its modules)."""
register = FORMATS.register
"""Class decorator: registers one instance of the class under its `name`."""
format_named = FORMATS.named
"""The registered row format `name`; ValueError naming `dataset.records` and the known ones."""
