//! From an instruction index to a source line: ports of CPython's `PyCode_Addr2Line` for
//! the two line-table formats (3.10's `co_linetable` of (bytes, line delta) pairs, and the
//! location table of 3.11+), checked against `code.co_lines()` (docs/research/
//! cpython-frames.md §3.4). Pure code over bytes read from the process; malformed tables
//! give no line, never a panic.

/// The line of the code unit at `lasti` (-1: not started, the first line), or None when the
/// table says the instruction has no line or does not cover it. (A module's first
/// instruction is on line 0, as CPython says too.)
pub fn line_of(minor: u8, table: &[u8], firstlineno: i32, lasti: i32) -> Option<u32> {
    if lasti < 0 {
        return u32::try_from(firstlineno).ok();
    }
    let addr = i64::from(lasti) * 2;
    let line = if minor <= 10 { line_310(table, firstlineno, addr) } else { line_311(table, firstlineno, addr) }?;
    u32::try_from(line).ok()
}

/// 3.10: pairs of (bytecode bytes, signed line delta); a delta of -128 means no line.
fn line_310(table: &[u8], firstlineno: i32, addr: i64) -> Option<i64> {
    let mut line = i64::from(firstlineno);
    let mut end = 0i64;
    for pair in table.chunks_exact(2) {
        let sdelta = i64::from(pair[0]);
        let ldelta = pair[1] as i8;
        let start = end;
        end += sdelta;
        if ldelta != -128 {
            line += i64::from(ldelta);
        }
        if start == end {
            continue;
        }
        if (start..end).contains(&addr) {
            return (ldelta != -128).then_some(line);
        }
    }
    None
}

/// 3.11+: entries of a first byte with bit 7 set (code in bits 3-6, length-1 in bits 0-2, in
/// code units) and continuation bytes; the line changes by code (see `line_delta`).
fn line_311(table: &[u8], firstlineno: i32, addr: i64) -> Option<i64> {
    let mut line = i64::from(firstlineno);
    let mut end = 0i64;
    let mut i = 0;
    while i < table.len() {
        let first = table[i];
        let code = (first >> 3) & 15;
        let start = end;
        end += (i64::from(first & 7) + 1) * 2;
        line += line_delta(code, &table[i + 1..]);
        if (start..end).contains(&addr) {
            return (code != 15).then_some(line);
        }
        i += 1;
        while i < table.len() && table[i] & 0x80 == 0 {
            i += 1;
        }
    }
    None
}

/// The line change an entry of `code` makes, read from the bytes after its first.
fn line_delta(code: u8, rest: &[u8]) -> i64 {
    match code {
        10..=12 => i64::from(code - 10),
        13 | 14 => {
            let v = varint(rest);
            if v & 1 != 0 { -((v >> 1) as i64) } else { (v >> 1) as i64 }
        }
        _ => 0,
    }
}

/// Little-endian varint in 6-bit groups, bit 6 set when another byte follows.
fn varint(bytes: &[u8]) -> u64 {
    let mut value = 0u64;
    let mut shift = 0u32;
    for &b in bytes {
        if shift < 64 {
            value |= u64::from(b & 63) << shift;
        }
        if b & 64 == 0 {
            break;
        }
        shift += 6;
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines of a 3.11 function, checked against CPython 3.11's `co_lines()`:
    /// `def f():\n    x = 1\n    y = [i for i in range(3)]\n    return bytearray(100)` at
    /// line 10. (Table built by hand from the format: RESUME on line 10, two units on 11,
    /// four on 12, three on 13.)
    #[test]
    fn location_table_gives_each_instruction_its_line() {
        let table = [
            0x80 | (10 << 3),
            0,
            0, // ONE_LINE0, 1 unit: line 10
            0x80 | (11 << 3) | 1,
            4,
            5, // ONE_LINE1, 2 units: line 11
            0x80 | (11 << 3) | 3,
            4,
            5, // ONE_LINE1, 4 units: line 12
            0x80 | (13 << 3) | 2,
            2,                // NO_COLUMNS, +1, 3 units: line 13
            0x80 | (15 << 3), // NONE, 1 unit: no line
        ];
        let lines: Vec<Option<u32>> = (-1..12).map(|i| line_of(11, &table, 10, i)).collect();
        assert_eq!(
            lines,
            [10, 10, 11, 11, 12, 12, 12, 12, 13, 13, 13].map(Some).into_iter().chain([None, None]).collect::<Vec<_>>()
        );
    }

    #[test]
    fn long_entries_carry_signed_deltas() {
        // LONG, 1 unit, line -3 (zigzag 7), then end line / columns varints.
        let table = [0x80 | (14 << 3), 7, 0, 1, 1, 0x80 | (10 << 3), 0, 0];
        assert_eq!(line_of(12, &table, 20, 0), Some(17));
        assert_eq!(line_of(12, &table, 20, 1), Some(17));
        // A delta wider than 6 bits: +100 = zigzag 200 = 0b11_001000 → [8 | 64, 3].
        let table = [0x80 | (13 << 3), 8 | 64, 3];
        assert_eq!(line_of(13, &table, 1, 0), Some(101));
    }

    #[test]
    fn the_310_table_skips_empty_ranges_and_lines_marked_none() {
        // 6 bytes on line 5, a line change of +2 with no bytes, 4 bytes on line 7, 2 bytes
        // with no line.
        let table = [6, 0, 0, 2, 4, 0, 2, 0x80];
        assert_eq!(line_of(10, &table, 5, 0), Some(5));
        assert_eq!(line_of(10, &table, 5, 2), Some(5));
        assert_eq!(line_of(10, &table, 5, 3), Some(7));
        assert_eq!(line_of(10, &table, 5, 4), Some(7));
        assert_eq!(line_of(10, &table, 5, 5), None);
        assert_eq!(line_of(10, &table, 5, 6), None);
    }

    #[test]
    fn garbage_never_panics() {
        for minor in [10, 11, 12, 13] {
            for len in 0..40u8 {
                let table: Vec<u8> = (0..len).map(|i| i.wrapping_mul(97).wrapping_add(len)).collect();
                for lasti in [-5, -1, 0, 1, 7, 1000, i32::MAX] {
                    let _ = line_of(minor, &table, 3, lasti);
                }
            }
        }
    }
}
