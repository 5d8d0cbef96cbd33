"""Multimodal element rules (spec §3.4): structure, URL whitelist + SSRF, local files, base64."""

from __future__ import annotations

import base64
import os

import pytest

from adapter.errors import MindIEError
from adapter.protocol import media
from adapter.protocol.media import (
    check_structure,
    is_blocked_address,
    text_for_text_only_model,
    validate_elements,
)

PNG_BYTES = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
JPEG_BYTES = b"\xff\xd8\xff\xe0" + b"\x00" * 16
PNG_URI = "data:image/png;base64," + base64.b64encode(PNG_BYTES).decode()
HOST = "cdn.example.com"
PUBLIC = "93.184.216.34"


class Resolver:
    """Injected DNS: records lookups and answers from a table."""

    def __init__(self, answers: list[str] | Exception):
        self.answers = answers
        self.calls: list[str] = []

    def __call__(self, host: str) -> list[str]:
        self.calls.append(host)
        if isinstance(self.answers, Exception):
            raise self.answers
        return self.answers


def message_of(fn, *args, **kwargs) -> str:
    with pytest.raises(MindIEError) as info:
        fn(*args, **kwargs)
    assert info.value.status == 422
    return info.value.message


def one(value, kind="image_url", **kwargs) -> media.MediaItem:
    elements = validate_elements([{"type": "text", "text": "t"}, {"type": kind, kind: value}], **kwargs)
    return elements[1].media


def url_error(url, answers=None, domains=(HOST,), kind="image_url") -> str:
    resolver = Resolver([PUBLIC] if answers is None else answers)
    return message_of(one, url, kind, resolver=resolver, allowed_domains=domains)


# ------------------------------------------------------------------ structure


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([{"type": "text", "text": 1}], "Request param text must be string"),
        ([{"text": None}], "Request param text must be string"),
        ([{"type": "image_url", "image_url": None}], "Request param image_url null"),
        ([{"type": "video_url", "video_url": None}], "Request param video_url null"),
        ([{"audio_url": None}], "Request param audio_url null"),
        ([{"image_url": PNG_URI}] * 21, "The number of multimodal url should be no more than 20"),
    ],
)
def test_structure(items, message):
    assert message_of(check_structure, items) == message


def test_twenty_media_are_allowed():
    items = [{"type": "text", "text": "t"}] + [{"image_url": PNG_URI}] * 20
    check_structure(items)
    assert len(validate_elements(items, allowed_domains=())) == 21


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("text", "The input type of 'str' is invalid, it should be a List[Dict]."),
        ({"type": "gif_url", "gif_url": "x"}, "Input type gif_url does not match the mm type."),
        (
            {"foo": "bar"},
            "Cannot infer the type of an inputs element: give 'type' or exactly one of text, image_url, "
            "video_url, audio_url",
        ),
        (
            {"text": "a", "image_url": PNG_URI},
            "Cannot infer the type of an inputs element: give 'type' or exactly one of text, image_url, "
            "video_url, audio_url",
        ),
        ({"type": "image_url"}, "Request param image_url null"),
        ({"type": "image_url", "image_url": 5}, "Input of image_url should be str or dict."),
        (
            {"type": "image_url", "image_url": {"detail": "high"}},
            "Request param image_url.url must be string",
        ),
        ({"type": "image_url", "image_url": ""}, "Request param image_url must be not empty"),
        ({"type": "text", "text": ""}, "Request param text must be not empty"),
    ],
)
def test_element_rules(item, message):
    assert message_of(validate_elements, [item], allowed_domains=()) == message


def test_type_is_inferred_and_url_object_form_is_accepted():
    elements = validate_elements(
        [
            {"text": "hi"},
            {"image_url": {"url": PNG_URI, "detail": "low"}},
            {"type": "image_url", "image_url": PNG_URI},
        ],
        allowed_domains=(),
    )
    assert [e.type for e in elements] == ["text", "image_url", "image_url"]
    assert elements[1].media.source == "base64" and elements[1].media.size == len(PNG_BYTES)


# ------------------------------------------------------------------ URL whitelist and SSRF


def test_url_media_disabled_without_whitelist(monkeypatch):
    monkeypatch.delenv(media.ALLOWED_MEDIA_DOMAINS_ENV, raising=False)
    resolver = Resolver([PUBLIC])
    assert message_of(one, f"https://{HOST}/a.png", resolver=resolver) == (
        "The media URL domain is not allowed: ALLOWED_MEDIA_DOMAINS_ENV is not set, so URL media are disabled"
    )
    monkeypatch.setenv(media.ALLOWED_MEDIA_DOMAINS_ENV, " , ")
    assert message_of(one, f"https://{HOST}/a.png", resolver=resolver).endswith("URL media are disabled")
    assert resolver.calls == []


def test_whitelist_from_env_is_trimmed_and_case_insensitive(monkeypatch):
    monkeypatch.setenv(media.ALLOWED_MEDIA_DOMAINS_ENV, "upload.media.org,  CDN.Example.com ")
    resolver = Resolver([PUBLIC])
    item = one("https://Cdn.EXAMPLE.com:8443/img/cat.PNG?size=big", resolver=resolver)
    assert (item.source, item.address, item.extension) == ("url", PUBLIC, ".png")
    assert resolver.calls == ["cdn.example.com"]


def test_host_not_in_whitelist_is_rejected_before_dns():
    resolver = Resolver([PUBLIC])
    msg = message_of(one, "http://evil.example.org/a.png", resolver=resolver, allowed_domains=[HOST])
    assert (
        msg == "The media URL domain is not allowed: Domain 'evil.example.org' is not in allowed domain list"
    )
    assert resolver.calls == []
    # no wildcard or suffix matching
    assert "not in allowed domain list" in url_error(f"http://sub.{HOST}/a.png")


@pytest.mark.parametrize("host", ["127.0.0.1.nip.io", "10-0-0-1.sslip.io", "nip.io", "x.xip.io", "a.nip.io."])
def test_wildcard_dns_domains_rejected_even_when_whitelisted(host):
    msg = url_error(f"http://{host}/a.png", domains=(host.rstrip("."),))
    assert msg == f"The media URL domain is not allowed: '{host.rstrip('.')}' is a wildcard DNS domain"


BLOCKED = [
    "127.0.0.1", "127.8.9.10", "10.1.2.3", "172.16.0.1", "172.31.255.255", "192.168.1.1", "169.254.169.254",
    "100.64.0.1", "100.127.255.254", "0.0.0.0", "224.0.0.1", "239.255.255.250", "240.0.0.1", "255.255.255.255",
    "::1", "::", "fe80::1", "fe80::1%eth0", "fc00::1", "fd12:3456::1", "ff02::1",
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "::127.0.0.1",
    "2002:7f00:1::1", "64:ff9b::a00:1", "not-an-ip",
]  # fmt: skip


@pytest.mark.parametrize("address", BLOCKED)
def test_blocked_addresses(address):
    assert is_blocked_address(address)
    assert url_error(f"https://{HOST}/a.png", answers=[address]) == (
        f"The media URL host '{HOST}' resolves to a disallowed address {address}"
    )


@pytest.mark.parametrize("address", [PUBLIC, "8.8.8.8", "2606:2800:220:1:248:1893:25c8:1946"])
def test_public_addresses_pass(address):
    assert not is_blocked_address(address)
    assert (
        one(f"https://{HOST}/a.png", resolver=Resolver([address]), allowed_domains=[HOST]).address == address
    )


def test_any_bad_address_rejects_the_host():
    assert "disallowed address 10.0.0.7" in url_error(f"https://{HOST}/a.png", answers=[PUBLIC, "10.0.0.7"])


@pytest.mark.parametrize("answers", [[], OSError("NXDOMAIN"), UnicodeError("bad label")])
def test_unresolvable_host(answers):
    assert (
        url_error(f"https://{HOST}/a.png", answers=answers)
        == f"The media URL host '{HOST}' cannot be resolved"
    )


@pytest.mark.parametrize(
    ("url", "domain", "address"),
    [("http://127.0.0.1/a.png", "127.0.0.1", "127.0.0.1"), ("http://[::1]:80/a.png", "::1", "::1")],
)
def test_ip_literal_hosts_are_checked_without_dns(url, domain, address):
    resolver = Resolver(AssertionError("no DNS for IP literals"))
    msg = message_of(one, url, resolver=resolver, allowed_domains=[domain])
    assert msg == f"The media URL host '{domain}' resolves to a disallowed address {address}"


def test_validated_address_is_returned():
    # a downloader must connect to this address, without resolving again
    item = one(f"http://{HOST}/v.mp4", "video_url", resolver=Resolver([PUBLIC]), allowed_domains=[HOST])
    assert (item.kind, item.address, item.extension) == ("video_url", PUBLIC, ".mp4")


@pytest.mark.parametrize(
    ("url", "kind", "message"),
    [
        (f"https://{HOST}/a.gif", "image_url", "image_url url must end with one of ['.jpg', '.jpeg', '.png']."),
        (f"https://{HOST}/a.png", "video_url", "video_url url must end with one of ['.mp4', '.avi', '.wmv']."),
        (f"https://{HOST}/a", "audio_url", "audio_url url must end with one of ['.mp3', '.wav', '.flac']."),
        (f"https://{HOST}/" + "a" * 4096 + ".png", "image_url",
         "The length of media_url should be less than 4096, but got 4124."),
        ("https:///a.png", "image_url", "Invalid URL: https:///a.png"),
        (f"https://{HOST}:99999/a.png", "image_url", f"Invalid URL: https://{HOST}:99999/a.png"),
        ("ftp://cdn.example.com/a.png", "image_url",
         "Unsupported scheme 'ftp' in image_url: only http, https, file and data are allowed"),
        ("gopher://x/a.png", "image_url",
         "Unsupported scheme 'gopher' in image_url: only http, https, file and data are allowed"),
    ],
)  # fmt: skip
def test_url_shape_rules(url, kind, message):
    assert url_error(url, kind=kind) == message


def test_uppercase_scheme_is_a_url():
    assert one(f"HTTPS://{HOST}/a.jpeg", resolver=Resolver([PUBLIC]), allowed_domains=[HOST]).source == "url"


# ------------------------------------------------------------------ local files


@pytest.fixture
def root(tmp_path):
    base = tmp_path / "multimodal_inputs"
    base.mkdir()
    return base


def make(path, data=PNG_BYTES, mode=0o640):
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def test_local_file_ok(root):
    path = make(root / "cat_1.png")
    for value in (str(path), f"file://{path}"):
        item = one(value, local_root=str(root), allowed_domains=())
        assert (item.source, item.location, item.size) == ("local", str(path), len(PNG_BYTES))
    make(root / "clip.mp4", mode=0o600)
    assert one(str(root / "clip.mp4"), "video_url", local_root=str(root)).extension == ".mp4"


def test_local_file_outside_root(root, tmp_path):
    outside = make(tmp_path / "secret.png")
    link = root / "link.png"
    link.symlink_to(outside)
    expected = (
        "Your input local file path is not allowed! please ensure your multimedia files are placed under "
        f"{root}"
    )
    for value in (str(outside), f"{root}/../secret.png", str(link), "/etc/passwd.png", "relative.png"):
        assert message_of(one, value, local_root=str(root)) == expected


def test_local_file_rules(root, monkeypatch):
    assert (
        message_of(one, str(root / "missing.png"), local_root=str(root))
        == "Can not find the input media file."
    )
    (root / "dir.png").mkdir()
    assert (
        message_of(one, str(root / "dir.png"), local_root=str(root)) == "Can not find the input media file."
    )
    make(root / "bad name.png")
    assert message_of(one, str(root / "bad name.png"), local_root=str(root)) == (
        "The media url contains dangerous characters, only allow a-zA-Z0-9_-./"
    )
    make(root / "open.png", mode=0o644)
    assert message_of(one, str(root / "open.png"), local_root=str(root)) == (
        "The permission of the input media file must be no broader than 0o640, got 0o644"
    )
    make(root / "exec.png", mode=0o740)
    assert "got 0o740" in message_of(one, str(root / "exec.png"), local_root=str(root))
    big = make(root / "big.png")
    os.truncate(big, 40 * 1024 * 1024 + 1)  # sparse: cheap
    assert message_of(one, str(big), local_root=str(root)) == "The size of image_url cannot exceed 40.0 MB"
    make(root / "a.png")
    assert message_of(one, str(root / "a.png"), "audio_url", local_root=str(root)) == (
        "audio_url url must end with one of ['.mp3', '.wav', '.flac']."
    )


def test_total_media_size_cap(root, monkeypatch):
    monkeypatch.setattr(media, "TOTAL_SIZE_LIMIT", len(PNG_BYTES) * 2)
    path = str(make(root / "a.png"))
    items = [{"text": "t"}] + [{"image_url": path}] * 3
    assert message_of(validate_elements, items, local_root=str(root)) == (
        f"The total media input cannot exceed {len(PNG_BYTES) * 2 / media.MIB} MB."
    )


# ------------------------------------------------------------------ base64


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize(
    ("value", "kind", "source", "extension"),
    [
        (PNG_URI, "image_url", "base64", ".png"),
        ("data:image/jpeg;base64," + b64(JPEG_BYTES), "image_url", "base64", ".jpg"),
        (b64(JPEG_BYTES), "image_url", "base64", ".jpg"),  # bare base64 = JPEG, image only
        ("data:video/x-msvideo;base64," + b64(b"RIFF...."), "video_url", "base64", ".avi"),
        ("data:audio/flac;base64," + b64(b"fLaC...."), "audio_url", "base64", ".flac"),
        ("data:audio/mpeg;base64," + b64(b"ID3....."), "audio_url", "base64", ".mp3"),
    ],
)
def test_base64_accepted(value, kind, source, extension):
    item = one(value, kind, allowed_domains=())
    assert (item.source, item.extension) == (source, extension)


@pytest.mark.parametrize(
    ("value", "kind", "message"),
    [
        ("data:image/gif;base64," + b64(PNG_BYTES), "image_url",
         "The MIME type 'image/gif' is not allowed for image_url, expected one of ['image/jpeg', 'image/png']"),
        ("data:image/png;base64," + b64(PNG_BYTES), "video_url",
         "The MIME type 'image/png' is not allowed for video_url, expected one of "
         "['video/mp4', 'video/x-msvideo', 'video/x-ms-wmv']"),
        ("data:image/png," + b64(PNG_BYTES), "image_url",
         "Expected format: data:<mime_type>/<subtype>;base64,<base64_data>"),
        ("data:image/png;base64,!!!!", "image_url", "The base64 data of image_url is invalid"),
        ("data:image/png;base64,iVBO Rw0K", "image_url", "The base64 data of image_url is invalid"),
        ("data:image/png;base64,", "image_url", "The base64 data of image_url is invalid"),
        ("data:image/png;base64," + b64(b"GIF89a" + b"\x00" * 10), "image_url",
         "The image_url data is not a valid JPEG or PNG image"),
        (b64(b"just some bytes!"), "image_url", "The image_url data is not a valid JPEG or PNG image"),
        (b64(b"RIFF...."), "video_url", "video_url url must end with one of ['.mp4', '.avi', '.wmv']."),
    ],
)  # fmt: skip
def test_base64_rejected(value, kind, message):
    assert message_of(one, value, kind, allowed_domains=()) == message


def test_base64_size_limit(monkeypatch):
    monkeypatch.setitem(media.SIZE_LIMITS, "image_url", len(PNG_BYTES) - 1)
    assert message_of(one, PNG_URI, allowed_domains=()) == (
        f"The size of image_url cannot exceed {(len(PNG_BYTES) - 1) / media.MIB} MB"
    )


# ------------------------------------------------------------------ text-only models


def test_text_only_model_policy():
    elements = validate_elements([{"text": "first"}, {"image_url": PNG_URI}, {"text": "second"}])
    assert text_for_text_only_model(elements) == "first"  # the others, media included, are ignored
    media_first = validate_elements([{"image_url": PNG_URI}, {"text": "x"}])
    assert message_of(text_for_text_only_model, media_first) == (
        "The first element of inputs must be a text element for a text-only model, got image_url"
    )


def test_default_resolver_is_injectable(monkeypatch):
    monkeypatch.setattr(media, "DEFAULT_RESOLVER", Resolver(["192.168.0.9"]))
    msg = message_of(one, f"https://{HOST}/a.png", allowed_domains=[HOST])
    assert msg == f"The media URL host '{HOST}' resolves to a disallowed address 192.168.0.9"
