"""The shared redactor: token shapes, secret-named values, user patterns, JSON safety."""

from __future__ import annotations

import json

import pytest

from batteries.audit import DuckDBAudit
from batteries.audit._encode import encode_payload
from batteries.audit._recorder import DuckDBRecorder
from batteries.redact import MIN_LITERAL, Redactor
from kernel import ConfigError, RunInfo

#: (secret text as it appears, the part that must not survive, the marker kind).
SHAPES = [
    ("sk-abcdEFGH1234ijklMNOP5678qrst", "abcdEFGH1234ijklMNOP", "openai_key"),
    ("sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz012345", "AbCdEfGhIjKlMnOpQrSt", "openai_key"),
    ("sk-ant-api03-AbCdEfGhIjKlMnOp_qrstUVWX-yz", "AbCdEfGhIjKlMnOp_qrst", "anthropic_key"),
    *[(f"{p}_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789", "AbCdEfGhIjKlMnOpQrSt", "github_token")
      for p in ("ghp", "gho", "ghu", "ghs", "ghr")],
    ("github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJ",
     "11ABCDEFG0123456789_abcdefghij", "github_token"),
    ("AKIAIOSFODNN7EXAMPLE", "IOSFODNN7EXAMPLE", "aws_access_key_id"),
    ("ASIAY34FZKBOKMUTVV7A", "Y34FZKBOKMUTVV7A", "aws_access_key_id"),
    ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
     "wJalrXUtnFEMI/K7MDENG", "secret"),
    ("xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx", "AbCdEfGhIjKlMnOpQrSt",
     "slack_token"),
    ("Authorization: Bearer abcdef0123456789TOKENVALUE", "abcdef0123456789TOKENVALUE",
     "authorization"),
    ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "dXNlcjpwYXNzd29yZA", "authorization"),
    ("bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig", "eyJhbGciOiJIUzI1NiJ9", "bearer"),
    ("https://alice:urlpassw0rd@example.com/x", "urlpassw0rd", "url_credentials"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEAx+y/z=\nQUJDREVGR0hJSg==\n"
     "-----END RSA PRIVATE KEY-----", "MIIEpAIBAAKCAQEA", "private_key"),
    ('"password": "hunter2hunter2"', "hunter2hunter2", "secret"),
    ("DB_PASSWORD=correct-horse", "correct-horse", "secret"),
]


class TestShapes:
    @pytest.mark.parametrize(("text", "secret", "kind"), SHAPES,
                             ids=[f"{s[2]}-{i}" for i, s in enumerate(SHAPES)])
    def test_each_shape_is_replaced(self, text: str, secret: str, kind: str) -> None:
        """Every known token shape is replaced by its marker, in raw text and in JSON."""
        r = Redactor()
        out = r.text(f"before {text} after")
        assert secret not in out and f"[REDACTED:{kind}]" in out
        assert out.startswith("before ") and out.endswith(" after")
        doc = r.json_text(json.dumps({"line": f"x {text} y", "n": 1}))
        assert secret not in doc
        assert json.loads(doc)["line"] == r.text(f"x {text} y")

    @pytest.mark.parametrize("text", [
        "task-abcdefghijklmnopqrstuvwxyz", "max_tokens: 100", "the high road through might",
        "call_key=abc", "Asia is big; 12 PASSED", "see https://example.com/a@b",
        "user@example.com", "tool_calls=3", "risk-assessment-of-everything-here",
    ])
    def test_ordinary_text_is_left_alone(self, text: str) -> None:
        """Text that merely contains a trigger ("gh", "key", "sk-") is not changed."""
        assert Redactor().text(text) == text

    def test_pem_cut_before_its_end_is_still_replaced(self) -> None:
        """A private key whose END line is missing is replaced to the end of the string."""
        r = Redactor()
        doc = r.json_text(json.dumps({"tail": "-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbn"
                                              "NzaC1rZXktdjEAAAAA", "n": 2}))
        assert json.loads(doc) == {"tail": "[REDACTED:private_key_start]", "n": 2}


class TestLiteralsAndNames:
    def test_secret_named_env_values_are_replaced_anywhere(self) -> None:
        """The value of DEPLOY_PASSWORD is replaced wherever it appears; HOME's is not."""
        r = Redactor.from_env({"DEPLOY_PASSWORD": "plainOldEnvSecret42", "HOME": "/root/home"})
        assert r.text("cd /root/home; login plainOldEnvSecret42") == (
            "cd /root/home; login [REDACTED:literal]")

    def test_json_escaped_literal(self) -> None:
        """A literal with a quote or backslash is found in its JSON-escaped form too."""
        r = Redactor(literals=['pa"ss\\word!'])
        doc = r.json_text(json.dumps({"line": 'x pa"ss\\word! y'}))
        assert json.loads(doc) == {"line": "x [REDACTED:literal] y"}

    def test_short_literals_are_not_substituted(self) -> None:
        """Literals shorter than MIN_LITERAL would mangle text; only the key rule takes them."""
        r = Redactor.from_env({}, context={"api_key": "abc"})
        assert r.text("abcdef") == "abcdef"
        assert len("abc") < MIN_LITERAL
        assert r.context({"api_key": "abc", "dir": "src"}) == {
            "api_key": "[REDACTED:context]", "dir": "src"}

    def test_run_info_is_redacted(self) -> None:
        """Name, subject and inputs (with the context by key) are redacted; the id is kept."""
        info = RunInfo(name="curl -H 'Authorization: Bearer abcdefgh12345678'",
                       inputs={"argv": ["x", "ghp_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"],
                               "context": {"token": "t0", "dir": "src"}})
        out = Redactor().run_info(info)
        assert out.run_id == info.run_id
        assert "abcdefgh12345678" not in out.name
        assert out.inputs == {"argv": ["x", "[REDACTED:github_token]"],
                              "context": {"token": "[REDACTED:context]", "dir": "src"}}


class TestUserPatterns:
    def test_patterns_and_env(self) -> None:
        """--redact patterns and $KERNEL_REDACT (one per line) are both applied."""
        r = Redactor.from_env({"KERNEL_REDACT": "internal-[a-z]{5}\n\n"},
                              patterns=["corp-[0-9]{6}"])
        assert r.text("corp-123456 internal-abcde") == "[REDACTED:pattern] [REDACTED:pattern]"

    def test_a_pattern_that_crosses_json_structure_keeps_json_valid(self) -> None:
        """A greedy user pattern cannot break the stored JSON: strings are redacted one by one."""
        r = Redactor(patterns=["password.*"])
        doc = r.json_text(json.dumps({"line": "my password is x", "n": 1}))
        assert json.loads(doc) == {"line": "my [REDACTED:pattern]", "n": 1}

    @pytest.mark.parametrize(("pattern", "why"), [("a(b", "not a valid regular expression"),
                                                   ("x*", "matches the empty string")])
    def test_bad_patterns_are_one_line_config_errors(self, pattern: str, why: str) -> None:
        """A bad pattern is a ConfigError naming it."""
        with pytest.raises(ConfigError, match=why):
            Redactor(patterns=[pattern])

    def test_repr_shows_no_secret(self) -> None:
        """The redactor's repr counts its literals and never shows them."""
        assert "hunter2hunter2" not in repr(Redactor(literals=["hunter2hunter2"]))


class TestRecorder:
    def test_a_key_printed_line_by_line_is_blanked_until_its_end(self) -> None:
        """Output lines after a BEGIN PRIVATE KEY line are replaced up to the END line."""
        audit = DuckDBAudit(":memory:", redactor=Redactor())
        rec = DuckDBRecorder(audit, RunInfo(name="cat id_rsa"))
        lines = ["before", "-----BEGIN RSA PRIVATE KEY-----", "MIIEpAIBAAKCAQEAbodyline1",
                 "QUJDREVGR0hJSkbodyline2", "-----END RSA PRIVATE KEY-----", "after"]
        for line in lines:
            rec.log_event("output", name="stdout", payload={"line": line})
        stored = [json.loads(p)["line"] for p in audit.journal.pending.payloads]
        assert stored == ["before", "[REDACTED:private_key_start]",
                          *["[REDACTED:private_key_start]"] * 3, "after"]

    def test_kernel_made_step_payloads_read_as_if_encoded_each_time(self) -> None:
        """A step's final flag and tool-call count are encoded once and reused; the stored
        text is what encoding and redacting it each time gives, for any redactor."""
        from kernel import Step, ToolCall

        steps = [Step(), Step(final=True), Step(tool_calls=[ToolCall("a"), ToolCall("b")]),
                 Step(), Step(output="out", payload={"x": 1})]
        for redactor in (Redactor(), Redactor(patterns=["tool_calls", "false"])):
            audit = DuckDBAudit(":memory:", redactor=redactor)
            rec = DuckDBRecorder(audit, RunInfo())
            for i, step in enumerate(steps):
                rec.on_step(i, step, 0.001)
            expected = [encode_payload({"final": s.final, "tool_calls": len(s.tool_calls),
                                        **({"output": s.output} if s.output else {}),
                                        **(s.payload or {})}, 1 << 16, 1 << 18, redactor)
                        for s in steps]
            assert audit.journal.pending.payloads == expected
            audit.redactor = Redactor(patterns=["final"])  # a new redactor is used at once
            rec.on_step(9, Step(), 0.001)
            assert audit.journal.pending.payloads[-1] == encode_payload(
                {"final": False, "tool_calls": 0}, 1 << 16, 1 << 18, audit.redactor)
            assert "final" not in audit.journal.pending.payloads[-1]


class TestEncode:
    def test_payload_is_redacted_before_it_is_capped(self) -> None:
        """A capped payload keeps no tail of a secret: redaction runs before the cut."""
        r = Redactor()
        token = "ghp_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
        text = encode_payload({"output": "x" * 500 + " " + token + " " + "y" * 20}, 100, 10_000, r)
        assert "AbCdEfGhIjKl" not in text and "Yz0123456789" not in text
        assert json.loads(text)["truncated"] is True
