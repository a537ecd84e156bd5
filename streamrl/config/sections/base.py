"""What every section is: a pydantic model that refuses unknown keys and checks assignments too.

Unknown keys are errors (``extra="forbid"``), so a typo never silently falls back to a default.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
