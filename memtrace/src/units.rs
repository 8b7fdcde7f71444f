//! How figures read, in one place: byte sizes (binary units), counts with thousands
//! separators, durations, per-second rates, signed growth and percentages. `report`, `top`
//! and `export` print numbers only through these.

/// `512 B`, `1.5 KiB`, `3.0 GiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{n} B") } else { format!("{v:.1} {}", UNITS[unit]) }
}

/// Bytes per second: `97.7 KiB/s`.
pub fn bytes_per_sec(v: f64) -> String {
    format!("{}/s", bytes(v as u64))
}

/// A change in bytes, always signed: `+3.9 KiB`, `-96 B`.
pub fn signed_bytes(v: i64) -> String {
    if v < 0 { format!("-{}", bytes(v.unsigned_abs())) } else { format!("+{}", bytes(v as u64)) }
}

/// `1,234,567`.
pub fn count(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A count and what is counted, singular or plural: `1 block`, `1,024 blocks`.
pub fn counted(n: u64, one: &str, many: &str) -> String {
    format!("{} {}", count(n), if n == 1 { one } else { many })
}

/// Events per second, short: `950`, `1.5k`, `2.0M`.
pub fn rate(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// `850ns`, `12.5µs`, `3.2ms`, `1.0s`.
pub fn duration(ns: u64) -> String {
    let v = ns as f64;
    if ns < 1_000 {
        format!("{ns}ns")
    } else if ns < 1_000_000 {
        format!("{:.1}µs", v / 1e3)
    } else if ns < 1_000_000_000 {
        format!("{:.1}ms", v / 1e6)
    } else {
        format!("{:.1}s", v / 1e9)
    }
}

/// `9.1%`.
pub fn percent(v: f64) -> String {
    format!("{v:.1}%")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_read_the_same_everywhere() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
        assert_eq!(bytes(u64::MAX), "16777216.0 TiB");
        assert_eq!(bytes_per_sec(100_000.0), "97.7 KiB/s");
        assert_eq!(signed_bytes(4000), "+3.9 KiB");
        assert_eq!(signed_bytes(-96), "-96 B");
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1000), "1,000");
        assert_eq!(count(1_234_567), "1,234,567");
        assert_eq!(counted(1, "block", "blocks"), "1 block");
        assert_eq!(counted(0, "block", "blocks"), "0 blocks");
        assert_eq!(counted(1200, "process", "processes"), "1,200 processes");
        assert_eq!(rate(950.4), "950");
        assert_eq!(rate(1500.0), "1.5k");
        assert_eq!(rate(2_000_000.0), "2.0M");
        assert_eq!(duration(850), "850ns");
        assert_eq!(duration(12_500), "12.5µs");
        assert_eq!(duration(3_200_000), "3.2ms");
        assert_eq!(duration(1_000_000_000), "1.0s");
        assert_eq!(percent(9.0909), "9.1%");
    }
}
