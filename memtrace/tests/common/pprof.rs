//! The messages of profile.proto (github.com/google/pprof/proto/profile.proto) that pprof
//! readers use, for decoding memtrace's profiles with prost in tests (`serve`'s unit and
//! integration tests include this file).
#![allow(dead_code)]

use std::io::Read as _;

use prost::Message;

#[derive(Clone, PartialEq, Message)]
pub struct Profile {
    #[prost(message, repeated, tag = "1")]
    pub sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    pub sample: Vec<Sample>,
    #[prost(message, repeated, tag = "3")]
    pub mapping: Vec<Mapping>,
    #[prost(message, repeated, tag = "4")]
    pub location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    pub function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    pub string_table: Vec<String>,
    #[prost(int64, tag = "9")]
    pub time_nanos: i64,
    #[prost(int64, tag = "10")]
    pub duration_nanos: i64,
    #[prost(message, optional, tag = "11")]
    pub period_type: Option<ValueType>,
    #[prost(int64, tag = "12")]
    pub period: i64,
    #[prost(int64, tag = "14")]
    pub default_sample_type: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct ValueType {
    #[prost(int64, tag = "1")]
    pub r#type: i64,
    #[prost(int64, tag = "2")]
    pub unit: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct Sample {
    #[prost(uint64, repeated, tag = "1")]
    pub location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    pub value: Vec<i64>,
    #[prost(message, repeated, tag = "3")]
    pub label: Vec<Label>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Label {
    #[prost(int64, tag = "1")]
    pub key: i64,
    #[prost(int64, tag = "2")]
    pub str: i64,
    #[prost(int64, tag = "3")]
    pub num: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct Mapping {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(int64, tag = "5")]
    pub filename: i64,
    #[prost(bool, tag = "7")]
    pub has_functions: bool,
}

#[derive(Clone, PartialEq, Message)]
pub struct Location {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(uint64, tag = "2")]
    pub mapping_id: u64,
    #[prost(uint64, tag = "3")]
    pub address: u64,
    #[prost(message, repeated, tag = "4")]
    pub line: Vec<Line>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Line {
    #[prost(uint64, tag = "1")]
    pub function_id: u64,
    #[prost(int64, tag = "2")]
    pub line: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct Function {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(int64, tag = "2")]
    pub name: i64,
    #[prost(int64, tag = "3")]
    pub system_name: i64,
    #[prost(int64, tag = "4")]
    pub filename: i64,
}

/// Decodes a gzipped profile, panicking with a clear message if it is not one.
pub fn decode_gzipped(bytes: &[u8]) -> Profile {
    assert!(bytes.starts_with(&[0x1f, 0x8b]), "not gzip: {:?}", &bytes[..bytes.len().min(64)]);
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(bytes).read_to_end(&mut raw).expect("gunzip");
    Profile::decode(raw.as_slice()).expect("profile.proto")
}

impl Profile {
    pub fn string(&self, i: i64) -> &str {
        &self.string_table[i as usize]
    }

    /// (type, unit) of each sample type.
    pub fn sample_types(&self) -> Vec<(String, String)> {
        self.sample_type.iter().map(|t| (self.string(t.r#type).into(), self.string(t.unit).into())).collect()
    }

    /// The function names of a sample's frames, innermost first (inlined ones included).
    pub fn functions(&self, s: &Sample) -> Vec<String> {
        s.location_id
            .iter()
            .flat_map(|id| {
                let loc = self.location.iter().find(|l| l.id == *id).expect("location");
                loc.line.iter().map(|line| {
                    let f = self.function.iter().find(|f| f.id == line.function_id).expect("function");
                    self.string(f.name).to_string()
                })
            })
            .collect()
    }

    /// A sample's string label.
    pub fn label(&self, s: &Sample, key: &str) -> Option<String> {
        s.label.iter().find(|l| self.string(l.key) == key && l.str != 0).map(|l| self.string(l.str).to_string())
    }

    /// A sample's numeric label.
    pub fn num_label(&self, s: &Sample, key: &str) -> Option<i64> {
        s.label.iter().find(|l| self.string(l.key) == key && l.str == 0).map(|l| l.num)
    }

    /// The sum of value `index` over the samples whose innermost frame of a user-space
    /// function (not the allocator's) is `function`.
    pub fn sum_for(&self, function: &str, index: usize) -> i64 {
        self.sample
            .iter()
            .filter(|s| self.functions(s).iter().any(|f| f == function))
            .filter(|s| self.label(s, "domain").as_deref() == Some("user"))
            .map(|s| s.value[index])
            .sum()
    }
}
