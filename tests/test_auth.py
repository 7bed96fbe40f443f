"""Tokens map to tenants; malformed token settings are refused with a clear message."""
import pytest

from service.auth import LOCAL_TENANT, Authenticator, TokenError, is_loopback, load_tokens, parse_tokens

T1, T2 = "a" * 20, "b" * 24


def test_parse_env_and_file(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"# teams\ncarol:{'c' * 16}\n\n")
    tokens = load_tokens(f"alice:{T1}, bob:{T2}", f)
    assert tokens == {T1: "alice", T2: "bob", "c" * 16: "carol"}


@pytest.mark.parametrize("text, message", [
    ("alice", "entry 1 is not 'tenant:token'"),
    (f"alice:{T1},:{T2}", "entry 2 is not 'tenant:token'"),
    ("alice:short", "shorter than 16 characters"),
])
def test_malformed_tokens(text, message):
    with pytest.raises(TokenError, match=message):
        parse_tokens(text)


def test_missing_tokens_file(tmp_path):
    with pytest.raises(TokenError, match="does not exist"):
        load_tokens("", tmp_path / "nope")


def test_bearer_lookup():
    auth = Authenticator({T1: "alice", T2: "bob"})
    assert auth.tenant_for(f"Bearer {T1}") == "alice"
    assert auth.tenant_for(f"Bearer {T2}") == "bob"
    assert auth.tenant_for(f"Bearer {T1}x") is None
    assert auth.tenant_for(T1) is None  # no scheme
    assert auth.tenant_for(None) is None


def test_without_tokens_everyone_is_local():
    assert Authenticator({}).tenant_for(None) == LOCAL_TENANT


def test_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("example.com")
