from __future__ import annotations

import pytest

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.redis_url import (
    RedisUrlError,
    SentinelUrl,
    is_sentinel_url,
    parse_sentinel_url,
    redact_redis_url,
)


def test_full_url_with_password_several_sentinels_and_db() -> None:
    url = parse_sentinel_url("redis+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2:26380,sentinel-c/loadmaster/2")
    assert url == SentinelUrl(
        sentinels=(("10.0.0.1", 26379), ("10.0.0.2", 26380), ("sentinel-c", 26379)),
        service_name="loadmaster",
        db=2,
        password="s3cret",
    )


def test_minimal_url_defaults_db_0_and_no_password() -> None:
    url = parse_sentinel_url("redis+sentinel://127.0.0.1:5000/mymaster")
    assert url.sentinels == (("127.0.0.1", 5000),)
    assert (url.service_name, url.db, url.password, url.username) == ("mymaster", 0, None, None)
    assert parse_sentinel_url("redis+sentinel://h:1/mymaster/").db == 0  # a trailing slash


def test_username_percent_escapes_ipv6_and_sentinel_password() -> None:
    url = parse_sentinel_url("REDIS+SENTINEL://app:p%40ss@[::1]:26379,h2:1/svc/1?sentinel_password=sp")
    assert url.username == "app" and url.password == "p@ss"
    assert url.sentinels == (("::1", 26379), ("h2", 1))
    assert url.sentinel_password == "sp"


def test_a_lone_word_before_at_is_the_password_as_in_redis_py() -> None:
    assert parse_sentinel_url("redis+sentinel://pw@h:1/svc").password == "pw"


@pytest.mark.parametrize(
    ("url", "part"),
    [
        ("redis://h:1/svc", "scheme"),
        ("h:1/svc", "scheme"),
        ("redis+sentinel:///svc", "host 1: empty"),
        ("redis+sentinel://h:1,,h3:3/svc", "host 2: empty"),
        ("redis+sentinel://h:1,:26379/svc", "host 2: missing host"),
        ("redis+sentinel://h:1,h2:port/svc", "host 2 port"),
        ("redis+sentinel://h:70000/svc", "host 1 port"),
        ("redis+sentinel://h:0/svc", "host 1 port"),
        ("redis+sentinel://[::1/svc", "host"),
        ("redis+sentinel://h:1", "service name"),
        ("redis+sentinel://h:1/", "service name"),
        ("redis+sentinel://h:1/svc/x", "db"),
        ("redis+sentinel://h:1/svc/-1", "db"),
        ("redis+sentinel://h:1/svc/0/extra", "path"),
        ("redis+sentinel://h:1/svc?timeout=5", "query: unknown parameter 'timeout'"),
        ("redis+sentinel://h:1/svc#frag", "fragment"),
    ],
)
def test_malformed_urls_name_the_part(url: str, part: str) -> None:
    with pytest.raises(RedisUrlError, match=part.replace("(", r"\(").replace("[", r"\[")) as caught:
        parse_sentinel_url(url)
    assert isinstance(caught.value, InvalidArgumentError) and isinstance(caught.value, ValueError)


def test_errors_never_carry_the_password() -> None:
    with pytest.raises(RedisUrlError) as caught:
        parse_sentinel_url("redis+sentinel://:hunter2@h:bad/svc")
    assert "hunter2" not in str(caught.value)


def test_is_sentinel_url() -> None:
    assert is_sentinel_url("redis+sentinel://h/svc")
    assert not is_sentinel_url("redis://h:6379/0")
    assert not is_sentinel_url("unix:///tmp/redis.sock")


def test_redaction_of_both_forms() -> None:
    assert (
        redact_redis_url("redis+sentinel://:pw@h1:1,h2:2/svc/3?sentinel_password=sp")
        == "redis+sentinel://:***@h1:1,h2:2/svc/3?sentinel_password=***"
    )
    assert redact_redis_url("redis://:pw@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact_redis_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert "pw" not in redact_redis_url("redis+sentinel://:pw@h:bad/svc")


def test_settings_refuse_a_malformed_sentinel_url_naming_the_field_and_part() -> None:
    from pydantic import ValidationError

    from loadmaster.common.config import Settings

    with pytest.raises(ValidationError, match=r"(?s)redis_url.*host 2 port"):
        Settings(redis_url="redis+sentinel://:pw@h1:1,h2:x/svc")
    assert Settings(redis_url="redis+sentinel://h1:1/svc").redis_url == "redis+sentinel://h1:1/svc"
