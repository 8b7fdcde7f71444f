//! Names for JIT-compiled code from the runtime's perf map: `/tmp/perf-PID.map`, one line
//! per piece of code, `START SIZE NAME` (hexadecimal start and size), the file `perf` reads
//! and node (`--perf-basic-prof`), the JVM's perf-map agents, Python 3.12 (`-X perf`) and
//! .NET (`DOTNET_PerfMapEnabled`) write. Frames in memory without a file are named by
//! address only without it.
use std::{collections::BTreeMap, io::Read as _, path::PathBuf};

/// A perf map read at most this far (a long-running JVM's can grow without end).
const MAX_BYTES: u64 = 256 << 20;

/// The code a perf map names, by start address.
#[derive(Debug, Default)]
pub struct PerfMap {
    /// start → (end, name); a later line for the same start replaces an earlier one (code
    /// compiled again at a reused address).
    entries: BTreeMap<u64, (u64, String)>,
}

impl PerfMap {
    /// Reads process `pid`'s perf map: from its own `/tmp` while it lives (another mount
    /// namespace's, in a container), else from ours. None when there is none.
    pub fn read(pid: u32) -> Option<Self> {
        let name = format!("perf-{pid}.map");
        let paths = [PathBuf::from(format!("/proc/{pid}/root/tmp/{name}")), PathBuf::from("/tmp").join(&name)];
        let file = paths.iter().find_map(|p| std::fs::File::open(p).ok())?;
        let mut text = String::new();
        if let Err(e) = file.take(MAX_BYTES).read_to_string(&mut text) {
            log::debug!("{name}: {e}");
            // What was read before a line that is not UTF-8 still names code.
        }
        Some(Self::parse(&text))
    }

    /// Every well-formed line of a perf map; others are skipped.
    pub fn parse(text: &str) -> Self {
        let mut entries = BTreeMap::new();
        for line in text.lines() {
            let mut parts = line.trim().splitn(3, ' ');
            let (Some(start), Some(size), Some(name)) = (parts.next(), parts.next(), parts.next()) else { continue };
            let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
            let (Some(start), Some(size)) = (hex(start), hex(size)) else { continue };
            let name = name.trim();
            if size == 0 || name.is_empty() {
                continue;
            }
            entries.insert(start, (start.saturating_add(size), name.to_string()));
        }
        Self { entries }
    }

    /// The name of the code at `addr`.
    pub fn name(&self, addr: u64) -> Option<&str> {
        let (_, (end, name)) = self.entries.range(..=addr).next_back()?;
        (addr < *end).then_some(name.as_str())
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_code_each_line_covers() {
        let map = PerfMap::parse(
            "7f0000001000 40 LazyCompile:~main /app/index.js:1\n\
             garbage line\n\
             7f0000002000 0 empty\n\
             0x7f0000003000 10 Interpreter:foo\n\
             7f0000001000 20 LazyCompile:*main /app/index.js:1\n",
        );
        assert_eq!(map.name(0x7f00_0000_0fff), None);
        // The later line for a start replaces the earlier one.
        assert_eq!(map.name(0x7f00_0000_1000), Some("LazyCompile:*main /app/index.js:1"));
        assert_eq!(map.name(0x7f00_0000_101f), Some("LazyCompile:*main /app/index.js:1"));
        assert_eq!(map.name(0x7f00_0000_1020), None);
        assert_eq!(map.name(0x7f00_0000_2000), None, "a zero-sized entry names nothing");
        assert_eq!(map.name(0x7f00_0000_3008), Some("Interpreter:foo"));
        assert!(PerfMap::parse("").is_empty());
    }

    proptest::proptest! {
        /// A perf map is another program's file: whatever it holds is read without panic,
        /// and a name found covers the address asked for.
        #[test]
        fn any_text_is_read(text in "[0-9a-fx \n:A-Za-z]{0,400}", addr in 0u64..0x1_0000) {
            let map = PerfMap::parse(&text);
            if let Some(name) = map.name(addr) {
                let (start, (end, n)) = map.entries.range(..=addr).next_back().unwrap();
                proptest::prop_assert!(*start <= addr && addr < *end && n == name);
            }
        }
    }
}
