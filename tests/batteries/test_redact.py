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
    ('DB_PASSWORD="correct horse battery staple"', "horse battery", "secret"),
    ("MYSQL_PWD=mysqlpwd123", "mysqlpwd123", "secret"),
    ("DB_PASS=dbpass12345", "dbpass12345", "secret"),
    ("sk_live_StripeSecret0123456789", "StripeSecret0123456789", "stripe_key"),
    ("glpat-GitLabToken0123456789ab", "GitLabToken0123456789", "gitlab_token"),
    ("hf_HuggingFaceToken0123456789abcdefgh", "HuggingFaceToken0123456789", "huggingface_token"),
    ("AIzaSyA-GoogleApiKey0123456789abcdefgh", "GoogleApiKey0123456789", "google_api_key"),
    ("xapp-1-A0123-4567-SlackAppToken", "SlackAppToken", "slack_token"),
    ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.JwtSignature012", "JwtSignature012", "jwt"),
    ("https://hooks.slack.com/services/T000/B000/SlackHookSecret", "SlackHookSecret", "webhook"),
    ("https://discord.com/api/webhooks/123/DiscordHookSecret", "DiscordHookSecret", "webhook"),
    ("redis://:RedisPassword9@cache:6379", "RedisPassword9", "url_credentials"),
    ("--token FlagTokenValue1", "FlagTokenValue1", "flag"),
    ("--db-password FlagPassword22", "FlagPassword22", "flag"),
    ('"--api-key", "FlagApiKey333"', "FlagApiKey333", "flag"),
    ("-----BEGIN PGP PRIVATE KEY BLOCK-----\n\nlQOYBGXpgpBody0123456789abcdef\n=AbCd\n"
     "-----END PGP PRIVATE KEY BLOCK-----", "pgpBody0123456789", "private_key"),
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
        "--token-file /etc/token.txt", "docker login --password-stdin registry.example.com",
        "git log --author 'Ann Lee'", "python -u script.py --no-auth server",
        "OLDPWD=/home/ann PWD=/home/ann/src", "pass: 3 failed: 0", "GIT_AUTHOR_NAME=Ann",
    ])
    def test_ordinary_text_is_left_alone(self, text: str) -> None:
        """Text that merely contains a trigger ("gh", "key", "sk-") is not changed."""
        assert Redactor().text(text) == text

    def test_a_cookie_header_is_replaced_to_the_end_of_its_line(self) -> None:
        """Every cookie of a Cookie or Set-Cookie header goes; the next line stays."""
        out = Redactor().text("Cookie: sessionid=abc123def; csrftoken=Xyz987\nnext line")
        assert out == "Cookie: [REDACTED:cookie]\nnext line"
        assert Redactor().text("Set-Cookie: id=SessionValue42; Path=/") == (
            "Set-Cookie: [REDACTED:cookie]")

    @pytest.mark.parametrize("form", ["raw", "json", "json twice"])
    def test_a_key_kept_in_a_json_file_is_replaced(self, form: str) -> None:
        """A PEM block with JSON escapes (a service account file) goes whole, as printed
        (raw), as an event's payload (JSON) and inside a JSON string in it (JSON twice)."""
        key = ("-----BEGIN PRIVATE KEY-----\nMIIEvQJsonKeyBody0123456789abcdef\n"
               "AbCdJsonKeyBody2==\n-----END PRIVATE KEY-----\n")
        text = json.dumps({"type": "service_account", "private_key": key}, indent=1)
        r = Redactor()
        if form == "raw":
            out = r.text(text)
        else:
            doc = json.dumps({"output": text if form == "json" else json.dumps(text)})
            out = r.json_text(doc)
            json.loads(out)
        assert "JsonKeyBody" not in out and "[REDACTED:private_key]" in out
        assert "service_account" in out

    def test_a_key_behind_grep_prefixes_is_replaced(self) -> None:
        """`grep -r` prints each line of a key behind `path:`: the block still goes whole."""
        lines = ["-----BEGIN OPENSSH PRIVATE KEY-----", "b3BlbnNzaC1rZXktdjEPrefixedBody1",
                 "AAAAPrefixedBody2xyz0123456789==", "-----END OPENSSH PRIVATE KEY-----"]
        text = "\n".join(f"ssh/id_ed25519:{line}" for line in lines) + "\nssh/config:Host x"
        out = Redactor().text(text)
        assert "PrefixedBody" not in out
        assert out == "ssh/id_ed25519:[REDACTED:private_key]\nssh/config:Host x"

    def test_a_key_whose_begin_was_cut_off_is_replaced_up_to_its_end(self) -> None:
        """The tail of a long stderr that starts inside a key: its body lines go."""
        text = ("QWERTYTailBody0123456789abcdefABCDEF+/==\nAbCdTailBody22\n"
                "-----END RSA PRIVATE KEY-----\nwarning: next")
        out = Redactor().text(text)
        assert "TailBody" not in out
        assert out == "[REDACTED:private_key]\nwarning: next"

    def test_a_header_without_its_end_keeps_the_text_after_its_body(self) -> None:
        """Only the key's own lines are replaced: the message lines after them stay."""
        r = Redactor()
        assert r.text("error: key file must start with -----BEGIN PRIVATE KEY-----\n"
                      "building\ntests passed: 42") == (
            "error: key file must start with [REDACTED:private_key_start]\n"
            "building\ntests passed: 42")
        assert r.text("-----BEGIN RSA PRIVATE KEY-----\nMIIEpCutBody0123456789abcdef\n"
                      "QUJDCutBody20123456789\nnot part of it") == (
            "[REDACTED:private_key_start]\nnot part of it")

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

    @pytest.mark.parametrize(("name", "secret"), [
        ("DB_PASS", True), ("MYSQL_PWD", True), ("SSHPASS", True), ("GH_AUTH", True),
        ("PW", True), ("DEPLOY_PASSWORD", True), ("PWD", False), ("OLDPWD", False),
        ("GIT_AUTHOR_NAME", False), ("PASSENGER_COUNT", False), ("BYPASS_CACHE", False),
        ("AUTHENTICATION_MODE", False)])
    def test_which_names_are_secret(self, name: str, secret: bool) -> None:
        """`PASS`, `PW` and `AUTH` count as a word of a name, not inside a longer one."""
        r = Redactor.from_env({name: "SomeLongValue42"})
        assert (r.text("x SomeLongValue42") == "x [REDACTED:literal]") is secret

    def test_the_argument_after_a_secret_flag_is_replaced(self) -> None:
        """In an argument list (a run's argv), the value after `--token` goes; a path after
        `--token-file` and an option after `--password-stdin` stay."""
        info = RunInfo(inputs={"argv": ["deploy", "--token", "ArgvToken123", "--token-file",
                                        "/etc/tok", "--password-stdin", "reg", "--password",
                                        "ArgvPassword9", "-v"]})
        assert Redactor().run_info(info).inputs["argv"] == [
            "deploy", "--token", "[REDACTED:flag]", "--token-file", "/etc/tok",
            "--password-stdin", "reg", "--password", "[REDACTED:flag]", "-v"]

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
        """Output lines after a BEGIN PRIVATE KEY line are replaced up to the END line
        (which is kept: it holds no secret); the line after it is kept."""
        audit = DuckDBAudit(":memory:", redactor=Redactor())
        rec = DuckDBRecorder(audit, RunInfo(name="cat id_rsa"))
        lines = ["before", "-----BEGIN RSA PRIVATE KEY-----", "MIIEpAIBAAKCAQEAbodyline1",
                 "QUJDREVGR0hJSkbodyline2", "-----END RSA PRIVATE KEY-----", "after"]
        for line in lines:
            rec.log_event("output", name="stdout", payload={"line": line})
        stored = [json.loads(p)["line"] for p in audit.journal.pending.payloads]
        assert stored == ["before", "[REDACTED:private_key_start]",
                          *["[REDACTED:private_key]"] * 2, "-----END RSA PRIVATE KEY-----",
                          "after"]

    def test_a_key_header_without_its_end_keeps_later_events_and_the_status(self) -> None:
        """After a header with no END line, only key-looking lines are replaced: an ordinary
        line, the run's status and its error stay as they were."""
        from kernel import RunStats, Status

        audit = DuckDBAudit(":memory:", redactor=Redactor())
        rec = DuckDBRecorder(audit, RunInfo(name="build"))
        for line in ["-----BEGIN PRIVATE KEY-----", "MIIEvQStateBody0123456789abcdefgh",
                     "building", "tests passed: 42"]:
            rec.log_event("output", name="stderr", payload={"line": line})
        row = rec._end(RunStats(Status.ERROR, error="exit 1: AbCdStateBody2+/0123456789==",
                                output="done"))
        payloads = [json.loads(p) for p in audit.journal.pending.payloads]
        assert [p.get("line") for p in payloads[:4]] == [
            "[REDACTED:private_key_start]", "[REDACTED:private_key]", "building",
            "tests passed: 42"]
        assert payloads[4]["status"] == "error"
        assert "StateBody" not in json.dumps(payloads) and "StateBody" not in repr(row)
        assert row[3] == "done" and row[4] == "exit 1: [REDACTED:private_key]"

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
