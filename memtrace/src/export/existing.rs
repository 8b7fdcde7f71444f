//! Recognising an earlier export at the output path: `export` replaces a file only if it
//! is an export of the same format (the rule `record` follows for recordings), so a
//! mistyped `-o` never destroys a source file, a document or another format's export.
use std::{
    fs::File,
    io::{BufRead as _, BufReader, Read as _},
    path::Path,
};

use super::ExportFormat;

/// How much of an existing file is looked at.
const SNIFF_BYTES: u64 = 64 << 10;

impl ExportFormat {
    /// What an export of this format is, for messages ("a folded-stacks export").
    pub fn noun(self) -> &'static str {
        match self {
            Self::Folded => "a folded-stacks export",
            Self::Svg => "an SVG flame graph from memtrace",
            Self::Pprof => "a pprof profile",
        }
    }

    /// Whether the file at `path` looks like an earlier export of this format.
    pub fn recognizes(self, path: &Path) -> bool {
        let Ok(file) = File::open(path) else { return false };
        let mut head = Vec::new();
        if file.take(SNIFF_BYTES).read_to_end(&mut head).is_err() {
            return false;
        }
        match self {
            Self::Folded => is_folded(&head),
            Self::Svg => is_memtrace_svg(&head),
            Self::Pprof => is_pprof(&head),
        }
    }
}

/// `frame;frame;frame value` lines (the last one may be cut by the sniffing limit); an
/// empty file is what a folded export of nothing is.
fn is_folded(head: &[u8]) -> bool {
    let complete = match head.iter().rposition(|&b| b == b'\n') {
        Some(end) => &head[..=end],
        None if head.is_empty() => return true,
        None if (head.len() as u64) < SNIFF_BYTES => head,
        None => return false,
    };
    let Ok(text) = std::str::from_utf8(complete) else { return false };
    BufReader::new(text.as_bytes()).lines().map_while(Result::ok).all(|line| {
        line.rsplit_once(' ').is_some_and(|(stack, value)| {
            !stack.is_empty() && !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit())
        })
    })
}

/// inferno's SVG with the title memtrace gives it.
fn is_memtrace_svg(head: &[u8]) -> bool {
    let text = String::from_utf8_lossy(head);
    text.trim_start().starts_with("<?xml") && text.contains("<svg") && text.contains("memtrace: ")
}

/// A gzipped profile.proto naming the sample types memtrace writes.
fn is_pprof(head: &[u8]) -> bool {
    if !head.starts_with(&[0x1f, 0x8b]) {
        return false;
    }
    let mut inflated = Vec::new();
    // The sniffed prefix may end mid-stream: what inflates is enough.
    let _ = flate2::read::GzDecoder::new(head).take(SNIFF_BYTES).read_to_end(&mut inflated);
    let has = |needle: &[u8]| inflated.windows(needle.len()).any(|w| w == needle);
    has(b"alloc_space") && has(b"inuse_space")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{export, report::ReportOptions};

    #[test]
    fn each_format_recognizes_its_own_exports_only() {
        let tmp = tempfile::Builder::new().prefix("memtrace-existing-").tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let summary = crate::report::tests::summary(&ReportOptions {
            by: crate::grouping::GroupBy::Stack,
            split_processes: true,
            ..Default::default()
        });
        let mut files = Vec::new();
        for format in [ExportFormat::Folded, ExportFormat::Svg, ExportFormat::Pprof] {
            let mut out = Vec::new();
            match format {
                ExportFormat::Folded => export::write_folded(&summary, export::Weight::Bytes, &mut out),
                ExportFormat::Svg => export::write_svg(&summary, export::Weight::Bytes, &mut out),
                ExportFormat::Pprof => export::write_pprof(&summary, &mut out),
            }
            .unwrap();
            let path = dir.join(format!("{format:?}"));
            std::fs::write(&path, out).unwrap();
            files.push((format, path));
        }
        let source = dir.join("prog.c");
        std::fs::write(&source, "int main(void) { return 0; }\n").unwrap();
        let recording = crate::report::tests::recording();
        for (format, _) in &files {
            for (other, path) in &files {
                assert_eq!(format.recognizes(path), format == other, "{format:?} on {other:?}");
            }
            assert!(!format.recognizes(&source), "{format:?}");
            assert!(!format.recognizes(recording), "{format:?}");
        }
    }
}
