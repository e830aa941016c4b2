//! Instants as milliseconds since the Unix epoch, in UTC.
//!
//! Both databases store instants as `BIGINT` milliseconds, so SQLite and PostgreSQL
//! compare and order them identically. The wire format is RFC 3339 with millisecond
//! precision in UTC (`2026-11-30T03:20:01.123Z`).

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::ParseError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(i64);

const MILLISECONDS_PER_DAY: i64 = 86_400_000;
/// Years outside 0000..=9999 cannot be written in RFC 3339's four-digit year.
const YEAR_MIN: i64 = 0;
const YEAR_MAX: i64 = 9999;

impl Timestamp {
    pub const fn from_unix_milliseconds(milliseconds: i64) -> Timestamp {
        Timestamp(milliseconds)
    }

    pub const fn unix_milliseconds(self) -> i64 {
        self.0
    }

    pub fn plus_seconds(self, seconds: i64) -> Timestamp {
        Timestamp(self.0.saturating_add(seconds.saturating_mul(1000)))
    }

    pub fn plus_milliseconds(self, milliseconds: i64) -> Timestamp {
        Timestamp(self.0.saturating_add(milliseconds))
    }

    /// Parses RFC 3339 (`2026-11-30T03:20:01Z`, `2026-11-30T11:20:01.5+08:00`).
    /// Sub-millisecond digits are truncated.
    pub fn parse_rfc3339(text: &str) -> Result<Timestamp, ParseError> {
        parse_rfc3339(text).ok_or_else(|| {
            ParseError::new(format!(
                "'{}' is not an RFC 3339 timestamp such as 2026-11-30T03:20:01Z",
                text.chars().take(40).collect::<String>()
            ))
        })
    }

    pub fn to_rfc3339(self) -> String {
        self.to_string()
    }
}

/// Days since 1970-01-01 for a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month_index = (month + 9) % 12;
    let day_of_year = (153 * month_index + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// The inverse of [`days_from_civil`].
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        _ => {
            let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
            if leap { 29 } else { 28 }
        }
    }
}

fn parse_digits(bytes: &[u8]) -> Option<i64> {
    if bytes.is_empty() || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(
        bytes
            .iter()
            .fold(0, |value, digit| value * 10 + i64::from(digit - b'0')),
    )
}

fn parse_rfc3339(text: &str) -> Option<Timestamp> {
    let bytes = text.as_bytes();
    if bytes.len() < 20 || bytes.len() > 40 {
        return None;
    }
    let separators_ok = bytes[4] == b'-'
        && bytes[7] == b'-'
        && matches!(bytes[10], b'T' | b't' | b' ')
        && bytes[13] == b':'
        && bytes[16] == b':';
    if !separators_ok {
        return None;
    }
    let year = parse_digits(&bytes[0..4])?;
    let month = parse_digits(&bytes[5..7])?;
    let day = parse_digits(&bytes[8..10])?;
    let hour = parse_digits(&bytes[11..13])?;
    let minute = parse_digits(&bytes[14..16])?;
    let second = parse_digits(&bytes[17..19])?;
    if !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 59
    {
        return None;
    }
    let mut rest = &bytes[19..];
    let mut milliseconds = 0;
    if rest.first() == Some(&b'.') {
        let fraction_length = rest[1..]
            .iter()
            .take_while(|byte| byte.is_ascii_digit())
            .count();
        if fraction_length == 0 || fraction_length > 9 {
            return None;
        }
        let fraction = &rest[1..1 + fraction_length];
        let mut padded = [b'0'; 3];
        for (slot, digit) in padded.iter_mut().zip(fraction) {
            *slot = *digit;
        }
        milliseconds = parse_digits(&padded)?;
        rest = &rest[1 + fraction_length..];
    }
    let offset_minutes = match rest {
        [b'Z' | b'z'] => 0,
        [sign @ (b'+' | b'-'), hours @ .., b':', _, _] if hours.len() == 2 => {
            let offset_hours = parse_digits(hours)?;
            let offset_minutes = parse_digits(&rest[4..6])?;
            if offset_hours > 23 || offset_minutes > 59 {
                return None;
            }
            let total = offset_hours * 60 + offset_minutes;
            if *sign == b'+' { total } else { -total }
        }
        _ => return None,
    };
    let days = days_from_civil(year, month, day);
    let local =
        days * MILLISECONDS_PER_DAY + ((hour * 60 + minute) * 60 + second) * 1000 + milliseconds;
    Some(Timestamp(local - offset_minutes * 60_000))
}

impl Timestamp {
    /// RFC 3339 in UTC with milliseconds, `YYYY-MM-DDTHH:MM:SS.mmmZ`, the year clamped
    /// to four digits. Written digit by digit: every answer that shows a reservation
    /// formats two or more of these, and `write!` with seven padded integers cost ten
    /// times as much (docs/BENCHMARKS.md, twenty-third session).
    fn rfc3339(self) -> [u8; 24] {
        let days = self.0.div_euclid(MILLISECONDS_PER_DAY);
        let millisecond_of_day = self.0.rem_euclid(MILLISECONDS_PER_DAY);
        let (year, month, day) = civil_from_days(days);
        let year = year.clamp(YEAR_MIN, YEAR_MAX);
        let second_of_day = millisecond_of_day / 1000;
        let mut text = *b"0000-00-00T00:00:00.000Z";
        write_digits(&mut text[0..4], year);
        write_digits(&mut text[5..7], month);
        write_digits(&mut text[8..10], day);
        write_digits(&mut text[11..13], second_of_day / 3600);
        write_digits(&mut text[14..16], second_of_day / 60 % 60);
        write_digits(&mut text[17..19], second_of_day % 60);
        write_digits(&mut text[20..23], millisecond_of_day % 1000);
        text
    }
}

/// `value` (not negative, fewer digits than `digits` has places) in decimal, zero-padded.
fn write_digits(digits: &mut [u8], mut value: i64) {
    debug_assert!(value >= 0, "{value} is negative");
    for digit in digits.iter_mut().rev() {
        *digit = b'0' + (value % 10) as u8;
        value /= 10;
    }
    debug_assert_eq!(value, 0, "more digits than places");
}

impl fmt::Display for Timestamp {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.rfc3339();
        formatter.write_str(std::str::from_utf8(&text).expect("ASCII digits and separators"))
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let text = self.rfc3339();
        serializer.serialize_str(std::str::from_utf8(&text).expect("ASCII digits and separators"))
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Timestamp, D::Error> {
        let text = String::deserialize(deserializer)?;
        Timestamp::parse_rfc3339(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_the_epoch_and_a_known_instant() {
        assert_eq!(Timestamp(0).to_string(), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            Timestamp(1_796_008_801_123).to_string(),
            "2026-11-30T03:20:01.123Z"
        );
    }

    #[test]
    fn formats_as_padded_decimal_fields_would_across_the_whole_range() {
        let padded = |instant: Timestamp| {
            let days = instant.0.div_euclid(MILLISECONDS_PER_DAY);
            let millisecond_of_day = instant.0.rem_euclid(MILLISECONDS_PER_DAY);
            let (year, month, day) = civil_from_days(days);
            let year = year.clamp(YEAR_MIN, YEAR_MAX);
            let second_of_day = millisecond_of_day / 1000;
            format!(
                "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
                second_of_day / 3600,
                second_of_day / 60 % 60,
                second_of_day % 60,
                millisecond_of_day % 1000
            )
        };
        let mut milliseconds = -70_000_000_000_000_i64; // before year 0: clamped
        while milliseconds < 260_000_000_000_000 {
            for instant in [
                Timestamp(milliseconds),
                Timestamp(milliseconds + 86_399_999),
            ] {
                assert_eq!(instant.to_string(), padded(instant));
                assert_eq!(
                    serde_json::to_string(&instant).unwrap(),
                    format!("\"{}\"", padded(instant))
                );
            }
            milliseconds += 3_333_333_333_333 / 7 + 4_321;
        }
        for extreme in [i64::MIN / 2, -1, 0, 1, 999, 1_000, i64::MAX / 2] {
            assert_eq!(Timestamp(extreme).to_string(), padded(Timestamp(extreme)));
        }
    }

    #[test]
    fn parses_offsets_fractions_and_lowercase_separators() {
        let utc = Timestamp::parse_rfc3339("2026-11-30T03:20:01.123Z").unwrap();
        assert_eq!(utc, Timestamp(1_796_008_801_123));
        let shanghai = Timestamp::parse_rfc3339("2026-11-30T11:20:01.123456+08:00").unwrap();
        assert_eq!(shanghai, utc);
        assert_eq!(
            Timestamp::parse_rfc3339("2026-11-30t03:20:01z").unwrap(),
            Timestamp(1_796_008_801_000)
        );
    }

    #[test]
    fn refuses_impossible_dates_and_loose_formats() {
        for bad in [
            "2026-02-29T00:00:00Z",
            "2026-13-01T00:00:00Z",
            "2026-11-30T24:00:00Z",
            "2026-11-30T03:20:01",
            "2026-11-30",
            "1796008801123",
            "2026-11-30T03:20:01.Z",
            "2026-11-30T03:20:01+8:00",
        ] {
            assert!(
                Timestamp::parse_rfc3339(bad).is_err(),
                "{bad} should be refused"
            );
        }
    }

    #[test]
    fn formatting_then_parsing_returns_the_same_instant_across_centuries() {
        let mut milliseconds = -62_000_000_000_000_i64; // year ~0005
        while milliseconds < 253_000_000_000_000 {
            let instant = Timestamp(milliseconds);
            assert_eq!(
                Timestamp::parse_rfc3339(&instant.to_string()).unwrap(),
                instant
            );
            milliseconds += 7_777_777_777_777 / 13 + 123;
        }
    }
}
