"""Certificates past their dates, said where an operator looks.

gRPC serves (and dials with) whatever certificate it is given: an expired one, or one not
valid yet (a clock behind, a renewal issued for later), makes every handshake fail at the
peer, with a message on the peer's side about the peer's side. Each service checks its
certificate and CA when it reads them (at start, and when renewed files are read again) and
logs an error naming the setting and the date, or a warning EXPIRY_WARNING_DAYS ahead.
"""

from __future__ import annotations

import datetime
import logging

from cryptography import x509

log = logging.getLogger("hopline.runtime.tls")

EXPIRY_WARNING_DAYS = 7
_said: set[str] = set()  # problems logged: a gateway reads one file for each upstream


def check_dates(setting: str, path: str, pem: bytes, now: datetime.datetime | None = None) -> str:
    """Log what is wrong with the first certificate in `pem`'s dates; returns the problem
    ('' for none). A file that is not PEM is said by the pair and CA checks, not here."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return ""
    now = now or datetime.datetime.now(datetime.UTC)
    after, before = cert.not_valid_after_utc, cert.not_valid_before_utc
    if after <= now:
        problem = f"{setting}={path!r} expired on {after:%Y-%m-%d %H:%M} UTC"
        level, advice = logging.ERROR, "every handshake with it fails; renew it"
    elif before > now:
        problem = f"{setting}={path!r} is not valid until {before:%Y-%m-%d %H:%M} UTC"
        level, advice = logging.ERROR, "every handshake with it fails until then"
    elif after - now < datetime.timedelta(days=EXPIRY_WARNING_DAYS):
        problem = f"{setting}={path!r} expires on {after:%Y-%m-%d %H:%M} UTC"
        level, advice = logging.WARNING, "renew it (renewed files are read again)"
    else:
        return ""
    if problem not in _said:
        _said.add(problem)
        log.log(level, f"{problem}: {advice}", extra={"setting": setting, "path": path})
    return problem
