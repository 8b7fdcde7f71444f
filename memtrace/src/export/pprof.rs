//! The pprof profile (profile.proto), encoded by hand: a handful of messages, gzipped.
//! Samples carry alloc_objects/alloc_space/inuse_objects/inuse_space, the requested and
//! wasted bytes, and the blocks and bytes live at the domain's peak, labelled with domain,
//! process and pid; inlined frames become the lines of one location. A differential profile
//! holds a base recording's samples negated and labelled `pprof::base`, as `pprof
//! -diff_base` builds it.
use std::{collections::HashMap, io::Write, sync::Arc};

use anyhow::Result;

use super::process_name;
use crate::{grouping::domain_name, report::Summary, stacks::Frame};

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn field_varint(out: &mut Vec<u8>, field: u32, v: u64) {
    if v != 0 {
        varint(out, u64::from(field) << 3);
        varint(out, v);
    }
}

fn field_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    varint(out, (u64::from(field) << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn field_packed(out: &mut Vec<u8>, field: u32, values: impl IntoIterator<Item = u64>) {
    let mut packed = Vec::new();
    for v in values {
        varint(&mut packed, v);
    }
    field_bytes(out, field, &packed);
}

#[derive(Default)]
struct Strings {
    table: Vec<String>,
    index: HashMap<String, u64>,
}

impl Strings {
    fn new() -> Self {
        let mut s = Self::default();
        s.id("");
        s
    }

    fn id(&mut self, s: &str) -> u64 {
        if let Some(&i) = self.index.get(s) {
            return i;
        }
        let i = self.table.len() as u64;
        self.table.push(s.to_string());
        self.index.insert(s.to_string(), i);
        i
    }
}

/// The profile, before compression.
pub fn pprof_bytes(a: &Summary) -> Vec<u8> {
    pprof_bytes_of(a, None)
}

/// The sample types of `memtrace export --format pprof`, in their order in each sample.
const EXPORT_SAMPLE_TYPES: [(&str, &str); 8] = [
    ("alloc_objects", "count"),
    ("alloc_space", "bytes"),
    ("inuse_objects", "count"),
    ("inuse_space", "bytes"),
    ("requested_space", "bytes"),
    ("wasted_space", "bytes"),
    ("peak_inuse_objects", "count"),
    ("peak_requested_space", "bytes"),
];

/// The profile of `a`, less `base` if given (its samples negated), before compression.
pub fn pprof_bytes_of(a: &Summary, base: Option<&Summary>) -> Vec<u8> {
    let mut builder = ProfileBuilder::new(&EXPORT_SAMPLE_TYPES);
    let sides = std::iter::once((a, false)).chain(base.map(|b| (b, true)));
    for (side, negate) in sides {
        for row in &side.groups {
            let s = &row.stats;
            let values = [
                s.allocs,
                s.bytes_alloc,
                s.live_allocs,
                s.live_bytes_alloc,
                s.bytes_req,
                s.wasted(),
                s.live_allocs_at_peak,
                s.live_bytes_req_at_peak,
            ]
            .map(|v| if negate { (v as i64).wrapping_neg() } else { v as i64 });
            let process = process_name(side, row);
            let mut labels =
                vec![("domain", LabelValue::Str(domain_name(row.domain))), ("process", LabelValue::Str(&process))];
            if negate {
                labels.push(("pprof::base", LabelValue::Str("true")));
            }
            if let Some(&pid) = row.pids.first() {
                labels.push(("pid", LabelValue::Num(i64::from(pid))));
            }
            builder.add_sample(&super::row_frames(side, row), &values, &labels);
        }
    }
    builder.finish(&ProfileHeader {
        time_nanos: a.meta.start_unix_ns,
        duration_nanos: a.duration_ns,
        period_type: ("space", "bytes"),
        period: a.meta.sample_bytes.unwrap_or(1) as i64,
        default_sample_type: Some("alloc_space"),
    })
}

pub fn write_pprof(a: &Summary, out: &mut dyn Write) -> Result<()> {
    write_gzipped(&pprof_bytes(a), out)
}

pub fn write_gzipped(profile: &[u8], out: &mut dyn Write) -> Result<()> {
    let mut gz = flate2::write::GzEncoder::new(out, flate2::Compression::default());
    gz.write_all(profile)?;
    gz.finish()?;
    Ok(())
}

/// A sample label's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LabelValue<'a> {
    Str(&'a str),
    Num(i64),
}

/// What a profile says of itself besides its samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProfileHeader<'a> {
    pub time_nanos: u64,
    pub duration_nanos: u64,
    /// (type, unit) of the sampling period.
    pub period_type: (&'a str, &'a str),
    pub period: i64,
    /// None leaves it unset: consumers then show the last sample type (Go's heap profile).
    pub default_sample_type: Option<&'a str>,
}

/// A profile built sample by sample, with any sample types (`serve`'s Go-style heap and
/// allocs profiles): frames become locations and functions as in [`pprof_bytes`].
pub struct ProfileBuilder {
    strings: Strings,
    sample_types: Vec<Vec<u8>>,
    mappings: HashMap<Arc<str>, u64>,
    mapping_msgs: Vec<Vec<u8>>,
    functions: HashMap<(Arc<str>, Arc<str>), u64>,
    function_msgs: Vec<Vec<u8>>,
    locations: HashMap<LocationKey, u64>,
    location_msgs: Vec<Vec<u8>>,
    samples: Vec<Vec<u8>>,
}

/// What makes a location: its module's name and address, and the names of its inline
/// chain. The address alone does not tell frames apart: two modules of one name (two
/// builds of a program, two containers' `libc.so.6`), Python frames (whose address is the
/// line, in any file), and the stand-in frames of stackless sites (address 0) would share
/// one location, named after whichever came first.
#[derive(PartialEq, Eq, Hash)]
struct LocationKey {
    module: Arc<str>,
    address: u64,
    kernel: bool,
    lines: Vec<Line>,
}

/// A line of a location: function, file, line.
type Line = (Arc<str>, Option<Arc<str>>, Option<u32>);

impl ProfileBuilder {
    pub fn new(sample_types: &[(&str, &str)]) -> Self {
        let mut strings = Strings::new();
        let sample_types = sample_types
            .iter()
            .map(|(kind, unit)| {
                let mut vt = Vec::new();
                field_varint(&mut vt, 1, strings.id(kind));
                field_varint(&mut vt, 2, strings.id(unit));
                vt
            })
            .collect();
        Self {
            strings,
            sample_types,
            mappings: HashMap::new(),
            mapping_msgs: Vec::new(),
            functions: HashMap::new(),
            function_msgs: Vec::new(),
            locations: HashMap::new(),
            location_msgs: Vec::new(),
            samples: Vec::new(),
        }
    }

    fn location(&mut self, chain: &[&Frame]) -> u64 {
        let f = chain[chain.len() - 1];
        let key = LocationKey {
            module: f.module.clone(),
            address: f.address,
            kernel: f.kernel,
            lines: chain.iter().map(|c| (c.function.clone(), c.file.clone(), c.line)).collect(),
        };
        if let Some(&id) = self.locations.get(&key) {
            return id;
        }
        let id = self.locations.len() as u64 + 1;
        let mapping_id = match self.mappings.get(&f.module) {
            Some(&m) => m,
            None => {
                let m_id = self.mapping_msgs.len() as u64 + 1;
                let mut m = Vec::new();
                field_varint(&mut m, 1, m_id);
                field_varint(&mut m, 5, self.strings.id(&f.module));
                field_varint(&mut m, 7, 1); // has_functions
                self.mapping_msgs.push(m);
                self.mappings.insert(f.module.clone(), m_id);
                m_id
            }
        };
        let mut loc = Vec::new();
        field_varint(&mut loc, 1, id);
        field_varint(&mut loc, 2, mapping_id);
        field_varint(&mut loc, 3, f.address);
        for c in chain {
            let file: Arc<str> = c.file.clone().unwrap_or_else(|| "".into());
            let fkey = (c.function.clone(), file.clone());
            let function_id = match self.functions.get(&fkey) {
                Some(&id) => id,
                None => {
                    let fn_id = self.function_msgs.len() as u64 + 1;
                    let mut func = Vec::new();
                    field_varint(&mut func, 1, fn_id);
                    field_varint(&mut func, 2, self.strings.id(&c.function));
                    field_varint(&mut func, 3, self.strings.id(&c.function));
                    field_varint(&mut func, 4, self.strings.id(&file));
                    self.function_msgs.push(func);
                    self.functions.insert(fkey, fn_id);
                    fn_id
                }
            };
            let mut line = Vec::new();
            field_varint(&mut line, 1, function_id);
            field_varint(&mut line, 2, u64::from(c.line.unwrap_or(0)));
            field_bytes(&mut loc, 4, &line);
        }
        self.location_msgs.push(loc);
        self.locations.insert(key, id);
        id
    }

    /// One sample: its frames innermost first (an inline chain becomes the lines of one
    /// location), one value per sample type, and its labels.
    pub fn add_sample(&mut self, frames: &[Frame], values: &[i64], labels: &[(&str, LabelValue<'_>)]) {
        let mut location_ids = Vec::new();
        let mut chain: Vec<&Frame> = Vec::new();
        for f in frames {
            chain.push(f);
            if f.inlined {
                continue;
            }
            location_ids.push(self.location(&chain));
            chain.clear();
        }
        if !chain.is_empty() {
            location_ids.push(self.location(&chain));
        }
        let mut sample = Vec::new();
        field_packed(&mut sample, 1, location_ids);
        field_packed(&mut sample, 2, values.iter().map(|&v| v as u64));
        for (key, value) in labels {
            let mut label = Vec::new();
            field_varint(&mut label, 1, self.strings.id(key));
            match value {
                LabelValue::Str(s) => field_varint(&mut label, 2, self.strings.id(s)),
                LabelValue::Num(n) => field_varint(&mut label, 3, *n as u64),
            }
            field_bytes(&mut sample, 3, &label);
        }
        self.samples.push(sample);
    }

    /// The profile, before compression.
    pub fn finish(mut self, header: &ProfileHeader<'_>) -> Vec<u8> {
        let mut profile = Vec::new();
        for vt in &self.sample_types {
            field_bytes(&mut profile, 1, vt);
        }
        for s in &self.samples {
            field_bytes(&mut profile, 2, s);
        }
        for m in &self.mapping_msgs {
            field_bytes(&mut profile, 3, m);
        }
        for l in &self.location_msgs {
            field_bytes(&mut profile, 4, l);
        }
        for f in &self.function_msgs {
            field_bytes(&mut profile, 5, f);
        }
        let period_type = {
            let mut vt = Vec::new();
            field_varint(&mut vt, 1, self.strings.id(header.period_type.0));
            field_varint(&mut vt, 2, self.strings.id(header.period_type.1));
            vt
        };
        let default_type = header.default_sample_type.map(|t| self.strings.id(t));
        for s in &self.strings.table {
            field_bytes(&mut profile, 6, s.as_bytes());
        }
        field_varint(&mut profile, 9, header.time_nanos);
        field_varint(&mut profile, 10, header.duration_nanos);
        field_bytes(&mut profile, 11, &period_type);
        field_varint(&mut profile, 12, header.period as u64);
        if let Some(t) = default_type {
            field_varint(&mut profile, 14, t);
        }
        profile
    }

    /// The profile, gzipped (what pprof endpoints serve).
    pub fn finish_gzipped(self, header: &ProfileHeader<'_>) -> Vec<u8> {
        let bytes = self.finish(header);
        let mut gz = flate2::write::GzEncoder::new(Vec::with_capacity(bytes.len() / 4), flate2::Compression::fast());
        gz.write_all(&bytes).expect("writing to memory");
        gz.finish().expect("writing to memory")
    }
}
