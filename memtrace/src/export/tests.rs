//! The export paths on the report's test recording: folded stacks (root first, process at
//! the root, kernel frames marked), the SVG flame graph, and the pprof profile decoded with
//! prost against the messages of profile.proto it uses.
use std::{collections::BTreeMap, io::Read as _};

use prost::Message;

use super::*;
use crate::report::{
    ReportOptions,
    tests::{PID, summary},
};

fn stacks() -> Summary {
    summary(&ReportOptions { by: crate::grouping::GroupBy::Stack, split_processes: true, ..Default::default() })
}

#[test]
fn folded_stacks_start_at_the_process() {
    let folded = folded(&stacks(), Weight::Bytes);
    let want: BTreeMap<String, u64> = [
        ("app", 64),
        ("app;main;build_index;grow", 50_000),
        ("app;main;do_pipe2_[k];create_pipe_files_[k];alloc_pipe_info_[k]", 50 * 192),
        ("app;main;handle_connection;serve;parse_request", 10_000),
        ("app;main;app::collections::hash::map::HashMap<K,V,S>::insert", 5 << 20),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(folded, want, "an allocation without a stack is the process alone");

    let by_allocs = super::folded(&stacks(), Weight::Allocs);
    assert_eq!(by_allocs["app;main;handle_connection;serve;parse_request"], 100);
    let live = super::folded(&stacks(), Weight::Live);
    assert_eq!(live["app;main;handle_connection;serve;parse_request"], 200);
    assert_eq!(super::folded(&stacks(), Weight::Wasted)["app;main;build_index;grow"], 80);

    let mut out = Vec::new();
    write_folded(&stacks(), Weight::Bytes, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(text.lines().any(|l| l == "app;main;handle_connection;serve;parse_request 10000"), "{text}");

    // A process named with the separator, a line break and a number at its end.
    let mut odd = stacks();
    odd.comms.insert(PID, "run;1 42\n".into());
    let folded = super::folded(&odd, Weight::Bytes);
    assert_eq!(folded.get("run:1_42"), Some(&64), "{folded:#?}");
    assert!(folded.contains_key("run:1 42;main;build_index;grow"), "{folded:#?}");
}

#[test]
fn svg_flame_graphs_draw_the_stacks() {
    let mut out = Vec::new();
    write_svg(&stacks(), Weight::Bytes, &mut out).unwrap();
    let svg = String::from_utf8(out).unwrap();
    assert!(svg.starts_with("<?xml") && svg.contains("<svg"), "{}", &svg[..200]);
    assert!(svg.contains("memtrace: bytes requested"));
    assert!(svg.contains("parse_request") && svg.contains("alloc_pipe_info (9,600 bytes"));
    let empty = summary(&ReportOptions {
        by: crate::grouping::GroupBy::Stack,
        filters: crate::grouping::Filters { comm: Some("nobody".into()), ..Default::default() },
        ..Default::default()
    });
    // Nothing to draw is a page that says so (as folded and pprof write empty exports),
    // and a later export may replace it.
    let mut out = Vec::new();
    write_svg(&empty, Weight::Bytes, &mut out).unwrap();
    let svg = String::from_utf8(out).unwrap();
    assert!(svg.contains("memtrace: bytes requested") && svg.contains("nothing to draw: no stack has any"), "{svg}");
    let tmp = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(tmp.path(), &svg).unwrap();
    assert!(ExportFormat::Svg.recognizes(tmp.path()));
}

// The parts of profile.proto (github.com/google/pprof/proto/profile.proto) memtrace writes.
#[derive(Clone, PartialEq, Message)]
struct Profile {
    #[prost(message, repeated, tag = "1")]
    sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    sample: Vec<Sample>,
    #[prost(message, repeated, tag = "3")]
    mapping: Vec<Mapping>,
    #[prost(message, repeated, tag = "4")]
    location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    string_table: Vec<String>,
    #[prost(int64, tag = "9")]
    time_nanos: i64,
    #[prost(int64, tag = "10")]
    duration_nanos: i64,
    #[prost(message, optional, tag = "11")]
    period_type: Option<ValueType>,
    #[prost(int64, tag = "12")]
    period: i64,
    #[prost(int64, tag = "14")]
    default_sample_type: i64,
}

#[derive(Clone, PartialEq, Message)]
struct ValueType {
    #[prost(int64, tag = "1")]
    r#type: i64,
    #[prost(int64, tag = "2")]
    unit: i64,
}

#[derive(Clone, PartialEq, Message)]
struct Sample {
    #[prost(uint64, repeated, tag = "1")]
    location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    value: Vec<i64>,
    #[prost(message, repeated, tag = "3")]
    label: Vec<Label>,
}

#[derive(Clone, PartialEq, Message)]
struct Label {
    #[prost(int64, tag = "1")]
    key: i64,
    #[prost(int64, tag = "2")]
    str: i64,
    #[prost(int64, tag = "3")]
    num: i64,
}

#[derive(Clone, PartialEq, Message)]
struct Mapping {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(int64, tag = "5")]
    filename: i64,
    #[prost(bool, tag = "7")]
    has_functions: bool,
}

#[derive(Clone, PartialEq, Message)]
struct Location {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(uint64, tag = "2")]
    mapping_id: u64,
    #[prost(uint64, tag = "3")]
    address: u64,
    #[prost(message, repeated, tag = "4")]
    line: Vec<ProtoLine>,
}

#[derive(Clone, PartialEq, Message)]
struct ProtoLine {
    #[prost(uint64, tag = "1")]
    function_id: u64,
    #[prost(int64, tag = "2")]
    line: i64,
}

#[derive(Clone, PartialEq, Message)]
struct Function {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(int64, tag = "2")]
    name: i64,
    #[prost(int64, tag = "3")]
    system_name: i64,
    #[prost(int64, tag = "4")]
    filename: i64,
}

fn decoded() -> Profile {
    let mut gz = Vec::new();
    write_pprof(&stacks(), &mut gz).unwrap();
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut raw).unwrap();
    assert_eq!(raw, pprof_bytes(&stacks()), "the file is the profile, gzipped");
    Profile::decode(&raw[..]).unwrap()
}

#[test]
fn pprof_profiles_decode_with_every_sample_type() {
    let p = decoded();
    let s = |i: i64| p.string_table[i as usize].as_str();
    assert_eq!(s(0), "", "string 0 is empty");
    let types: Vec<(&str, &str)> = p.sample_type.iter().map(|t| (s(t.r#type), s(t.unit))).collect();
    assert_eq!(
        types,
        [
            ("alloc_objects", "count"),
            ("alloc_space", "bytes"),
            ("inuse_objects", "count"),
            ("inuse_space", "bytes"),
            ("requested_space", "bytes"),
            ("wasted_space", "bytes"),
            ("peak_inuse_objects", "count"),
            ("peak_requested_space", "bytes"),
        ]
    );
    assert_eq!(s(p.default_sample_type), "alloc_space");
    assert_eq!(p.time_nanos, 1_700_000_000_000_000_000);
    assert_eq!(p.period, 1);
    assert_eq!(p.sample.len(), 5);

    // Each sample: its function names, innermost first, and its values.
    let function_name = |id: u64| s(p.function.iter().find(|f| f.id == id).unwrap().name);
    let names = |sample: &Sample| -> Vec<&str> {
        sample
            .location_id
            .iter()
            .flat_map(|id| p.location.iter().find(|l| l.id == *id).unwrap().line.iter())
            .map(|l| function_name(l.function_id))
            .collect()
    };
    let parse = p.sample.iter().find(|x| names(x).first() == Some(&"parse_request")).expect("the parse_request sample");
    assert_eq!(names(parse), ["parse_request", "serve", "handle_connection", "main"]);
    assert_eq!(parse.value, [100, 100 * 112, 2, 2 * 112, 100 * 100, 100 * 12, 2, 200]);
    let labels: Vec<(&str, String)> = parse
        .label
        .iter()
        .map(|l| (s(l.key), if l.str != 0 { s(l.str).to_string() } else { l.num.to_string() }))
        .collect();
    assert_eq!(labels, [("domain", "user".into()), ("process", "app".into()), ("pid", PID.to_string())]);

    // An inline chain is one location with two lines, innermost first.
    let grow = p.sample.iter().find(|x| names(x).first() == Some(&"grow")).unwrap();
    assert_eq!(names(grow), ["grow", "build_index", "main"]);
    let first = p.location.iter().find(|l| l.id == grow.location_id[0]).unwrap();
    assert_eq!(first.line.len(), 2);
    assert_eq!(first.line.iter().map(|l| l.line).collect::<Vec<_>>(), [10, 300]);

    // Kernel frames, in the kernel's mapping.
    let kernel = p.sample.iter().find(|x| names(x).first() == Some(&"alloc_pipe_info")).unwrap();
    assert_eq!(names(kernel), ["alloc_pipe_info", "create_pipe_files", "do_pipe2", "main"]);
    let mapping = |loc: u64| {
        let m = p.location.iter().find(|l| l.id == loc).unwrap().mapping_id;
        s(p.mapping.iter().find(|x| x.id == m).unwrap().filename)
    };
    assert_eq!(mapping(kernel.location_id[0]), "[kernel]");
    assert_eq!(mapping(*kernel.location_id.last().unwrap()), "app");
    assert!(p.mapping.iter().all(|m| m.has_functions));
}

#[test]
fn the_peak_is_a_weight() {
    let peak = super::folded(&stacks(), Weight::Peak);
    assert_eq!(peak["app;main;app::collections::hash::map::HashMap<K,V,S>::insert"], 5 << 20);
    assert_eq!(peak["app;main;do_pipe2_[k];create_pipe_files_[k];alloc_pipe_info_[k]"], 192);
    // Each domain's stacks add up to its peak.
    assert_eq!(peak.values().sum::<u64>(), (5 << 20) + 50_000 + 200 + 64 + 192);
}

/// Rows the analysis leaves unnamed (as `export` asks) export exactly as named ones: each
/// export names them one at a time (all of a deep Python recording's at once took 970 MB).
#[test]
fn unnamed_rows_export_as_named_ones() {
    let unnamed_over = |min_size| {
        let opts = ReportOptions {
            by: crate::grouping::GroupBy::Stack,
            split_processes: true,
            rows_unnamed: true,
            filters: crate::grouping::Filters { min_size, ..Default::default() },
            ..Default::default()
        };
        summary(&opts)
    };
    let unnamed = || unnamed_over(None);
    assert!(unnamed().groups.iter().all(|r| r.frames.is_empty()));
    let export = |format, a: Summary, base: Option<&Summary>| {
        let mut out = Vec::new();
        write(format, a, base, Weight::Bytes, &mut out).unwrap();
        out
    };
    let folded = ExportFormat::Folded;
    assert!(export(folded, unnamed(), None) == export(folded, stacks(), None));
    let (base, named_base) = (unnamed_over(Some(1000)), filtered(1000));
    assert!(export(folded, unnamed(), Some(&base)) == export(folded, stacks(), Some(&named_base)));
    // (Flame graphs draw those lines, in colours of their own each time.)
    let svg = String::from_utf8(export(ExportFormat::Svg, unnamed(), None)).unwrap();
    assert!(svg.contains("parse_request") && svg.contains("alloc_pipe_info"));
    let decode = |gz: Vec<u8>| {
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut raw).unwrap();
        raw
    };
    assert!(
        decode(export(ExportFormat::Pprof, unnamed(), None)) == decode(export(ExportFormat::Pprof, stacks(), None))
    );
}

fn filtered(min_size: u64) -> Summary {
    summary(&ReportOptions {
        by: crate::grouping::GroupBy::Stack,
        split_processes: true,
        filters: crate::grouping::Filters { min_size: Some(min_size), ..Default::default() },
        ..Default::default()
    })
}

#[test]
fn differential_exports_hold_both_recordings() {
    // The base: only the blocks of 1000 bytes and more; this recording: everything.
    let (base, now) = (filtered(1000), stacks());
    let mut out = Vec::new();
    write(ExportFormat::Folded, stacks(), Some(&base), Weight::Allocs, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(text.lines().any(|l| l == "app;main;handle_connection;serve;parse_request 0 100"), "{text}");
    assert!(text.lines().any(|l| l == "app;main;build_index;grow 10 10"), "{text}");
    let mut svg = Vec::new();
    write(ExportFormat::Svg, stacks(), Some(&base), Weight::Bytes, &mut svg).unwrap();
    let svg = String::from_utf8(svg).unwrap();
    assert!(svg.contains("memtrace: change in bytes requested") && svg.contains("parse_request"), "{svg}");

    // pprof: the base's samples negated and labelled, so the sums are the change.
    let mut gz = Vec::new();
    write(ExportFormat::Pprof, now, Some(&base), Weight::Bytes, &mut gz).unwrap();
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut raw).unwrap();
    let p = Profile::decode(&raw[..]).unwrap();
    let s = |i: i64| p.string_table[i as usize].as_str();
    let is_base = |x: &Sample| x.label.iter().any(|l| s(l.key) == "pprof::base" && s(l.str) == "true");
    assert_eq!(p.sample.iter().filter(|x| is_base(x)).count(), 2, "the base's two stacks");
    assert!(p.sample.iter().filter(|x| is_base(x)).all(|x| x.value.iter().all(|&v| v <= 0)));
    let allocs: i64 = p.sample.iter().map(|x| x.value[0]).sum();
    assert_eq!(allocs, 100 + 50 + 1, "the allocations below 1000 bytes are the change");
}

/// Frames that share a module name and an address but not their names are locations of
/// their own: Python functions at one line of two files named alike, the stand-in frames of
/// stackless sites, two builds of one program. A stack ending in an inlined frame keeps it.
#[test]
fn pprof_locations_keep_frames_of_one_address_apart() {
    use crate::export::pprof::{LabelValue, ProfileBuilder, ProfileHeader};
    let frame = |function: &str, file: Option<&str>, module: &str, address: u64| crate::stacks::Frame {
        function: function.into(),
        file: file.map(Into::into),
        line: file.map(|_| 10),
        module: module.into(),
        address,
        kernel: false,
        python: file.is_some(),
        inlined: false,
        unknown: false,
        wrapper: false,
    };
    let inlined = crate::stacks::Frame { inlined: true, ..frame("helper", None, "app", 0x40) };
    let stacks = [
        vec![frame("load", Some("/srv/a/__init__.py"), "__init__.py", 10)],
        vec![frame("save", Some("/srv/b/__init__.py"), "__init__.py", 10)],
        vec![frame("[no stack: malloc]", None, "[unknown]", 0)],
        vec![frame("[no stack: mmap]", None, "[unknown]", 0)],
        vec![frame("parse", None, "server", 0x1234)],
        vec![frame("render", None, "server", 0x1234)],
        vec![frame("main", None, "app", 0x10), inlined],
    ];
    let mut builder = ProfileBuilder::new(&[("alloc_space", "bytes")]);
    for (i, frames) in stacks.iter().enumerate() {
        builder.add_sample(frames, &[i as i64 + 1], &[("pid", LabelValue::Num(1))]);
    }
    const HEADER: ProfileHeader<'static> = ProfileHeader {
        time_nanos: 1,
        duration_nanos: 1,
        period_type: ("space", "bytes"),
        period: 1,
        default_sample_type: None,
    };
    let raw = builder.finish(&HEADER);
    let p = Profile::decode(&raw[..]).unwrap();
    let s = |i: i64| p.string_table[i as usize].as_str();
    let function_name = |id: u64| s(p.function.iter().find(|f| f.id == id).unwrap().name);
    let names: Vec<Vec<&str>> = p
        .sample
        .iter()
        .map(|sample| {
            sample
                .location_id
                .iter()
                .flat_map(|id| p.location.iter().find(|l| l.id == *id).unwrap().line.iter())
                .map(|l| function_name(l.function_id))
                .collect()
        })
        .collect();
    assert_eq!(
        names,
        [
            vec!["load"],
            vec!["save"],
            vec!["[no stack: malloc]"],
            vec!["[no stack: mmap]"],
            vec!["parse"],
            vec!["render"],
            vec!["main", "helper"],
        ]
    );
    assert_eq!(p.location.len(), 8);
    // The same frames again are the same locations.
    let mut again = ProfileBuilder::new(&[("alloc_space", "bytes")]);
    for frames in stacks.iter().chain(stacks.iter()) {
        again.add_sample(frames, &[1], &[]);
    }
    let raw = again.finish(&HEADER);
    assert_eq!(Profile::decode(&raw[..]).unwrap().location.len(), 8);
}
