"""What `Limits`, `UsageLimits` and `RunInfo` refuse: one line naming the field."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from kernel import ConfigError, Limits, RunInfo, RunSpec, UsageLimits
from kernel._types import MAX_RUN_ID


class TestLimits:
    @pytest.mark.parametrize(("options", "message"), [
        ({"max_steps": math.nan}, "Limits.max_steps must be a whole number >= 0 or None, got nan"),
        ({"max_steps": 2.5}, "Limits.max_steps must be a whole number >= 0 or None, got 2.5"),
        ({"max_steps": 10.0}, "Limits.max_steps must be a whole number >= 0 or None, got 10.0"),
        ({"max_tool_calls": math.inf},
         "Limits.max_tool_calls must be a whole number >= 0 or None, got inf"),
        ({"max_input_tokens": math.nan},
         "Limits.max_input_tokens must be a whole number >= 0 or None, got nan"),
        ({"max_total_tokens": "9"},
         "Limits.max_total_tokens must be a whole number >= 0 or None, got '9'"),
        ({"checkpoint_every_steps": math.nan},
         "Limits.checkpoint_every_steps must be a whole number >= 1, got nan"),
        ({"checkpoint_every_steps": 1.5},
         "Limits.checkpoint_every_steps must be a whole number >= 1, got 1.5"),
        ({"timeout": "soon"}, "Limits.timeout must be a finite number, got 'soon'"),
        ({"checkpoint_every_seconds": "1"},
         "Limits.checkpoint_every_seconds must be a finite number, got '1'"),
        ({"soft_timeout": [1]}, "Limits.soft_timeout must be a finite number, got [1]"),
    ])
    def test_refused_with_one_line(self, options: dict[str, Any], message: str) -> None:
        """NaN, infinite, fractional and non-numeric values are refused, naming the field."""
        with pytest.raises(ConfigError) as err:
            Limits(**options)
        assert str(err.value) == message

    def test_whole_numbers_pass_and_floats_do_not(self) -> None:
        """Counts are whole numbers (0 and None included), as the spec reader wants them."""
        limits = Limits(max_steps=0, max_tool_calls=None, max_total_tokens=2**63,
                        checkpoint_every_steps=3, timeout=0.5, checkpoint_every_seconds=0)
        assert (limits.max_steps, limits.max_total_tokens) == (0, 2**63)
        with pytest.raises(ConfigError):
            Limits(max_tool_calls=3.0)  # type: ignore[arg-type]


class TestUsageLimits:
    @pytest.mark.parametrize(("options", "message"), [
        ({"max_cost_usd": math.nan}, "UsageLimits.max_cost_usd must be a finite number, got nan"),
        ({"max_runtime_seconds": math.inf},
         "UsageLimits.max_runtime_seconds must be a finite number, got inf"),
        ({"max_cost_usd": -0.5}, "UsageLimits.max_cost_usd must be >= 0 or None, got -0.5"),
        ({"max_steps": -1}, "UsageLimits.max_steps must be a whole number >= 0 or None, got -1"),
        ({"max_total_tokens": 1e3},
         "UsageLimits.max_total_tokens must be a whole number >= 0 or None, got 1000.0"),
        ({"max_tool_calls": math.nan},
         "UsageLimits.max_tool_calls must be a whole number >= 0 or None, got nan"),
    ])
    def test_refused_with_one_line(self, options: dict[str, Any], message: str) -> None:
        """A budget's caps are checked as Limits are: a NaN cap is no longer ignored."""
        with pytest.raises(ConfigError) as err:
            UsageLimits(**options)
        assert str(err.value) == message

    def test_zero_is_a_cap(self) -> None:
        """0 (a budget used up) is a cap; a negative cost is not."""
        assert UsageLimits(max_cost_usd=0.0, max_runtime_seconds=0, max_steps=0).max_cost_usd == 0
        with pytest.raises(ConfigError):
            UsageLimits(max_runtime_seconds=-1.0)


class TestRunIds:
    @pytest.mark.parametrize(("run_id", "message"), [
        ("", "RunInfo.run_id must not be empty"),
        (".", "RunInfo.run_id must not be '.'"),
        ("..", "RunInfo.run_id must not be '..'"),
        ("../victim", "RunInfo.run_id must not contain '/' or a backslash, got '../victim'"),
        ("a\\b", "RunInfo.run_id must not contain '/' or a backslash, got 'a\\\\b'"),
        ("a\x00b", "RunInfo.run_id must not contain unprintable characters (control "
                   "characters, line breaks), got 'a\\x00b'"),
        ("a\nb", "RunInfo.run_id must not contain unprintable characters (control "
                 "characters, line breaks), got 'a\\nb'"),
        ("x" * (MAX_RUN_ID + 1), f"RunInfo.run_id must be at most {MAX_RUN_ID} characters, "
                                 f"got {MAX_RUN_ID + 1}"),
        (7, "RunInfo.run_id must be a string, got int"),
    ])
    def test_refused_with_one_line(self, run_id: Any, message: str) -> None:
        """A run id that is not one safe file name is refused where it is made."""
        with pytest.raises(ConfigError) as err:
            RunInfo(run_id=run_id)
        assert str(err.value) == message

    def test_a_stored_spec_with_such_an_id_is_refused(self) -> None:
        """`RunSpec.from_json` refuses it too, with one line (a batch task or a resume);
        ids made by hosts and batches (uuid hex, `r1`, `task-1.2`) still read."""
        for fine in ("01a207300dff76ccad581353b10fdf4a", "r1", "task-1.2_b", "x" * MAX_RUN_ID):
            ok = {"agent": {"kind": "command", "argv": ["true"]}, "info": {"run_id": fine}}
            assert RunSpec.from_json(json.dumps(ok)).run_id == fine
        spec = {"agent": {"kind": "command", "argv": ["true"]}, "info": {"run_id": ".."}}
        with pytest.raises(ConfigError) as err:
            RunSpec.from_json(json.dumps(spec))
        assert str(err.value).startswith("run spec: ")
        assert "run_id must not be '..'" in str(err.value)
        assert "\n" not in str(err.value)
