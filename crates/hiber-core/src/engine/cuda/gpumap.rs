//! `--gpu-map OLD=NEW[,...]`: which GPU of this machine takes the state of which GPU of
//! the image. GPUs are named by UUID (as nvidia-smi prints them) or by index (the image's
//! indices on the left, this machine's on the right).

use std::collections::BTreeMap;

use super::{CuUuid, Gpu};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GpuMapError {
    #[error("'{0}' is not OLD=NEW")]
    Syntax(String),
    #[error("the image has no GPU '{0}'")]
    UnknownOld(String),
    #[error("this machine has no GPU '{0}'")]
    UnknownNew(String),
    #[error("GPU {old} is mapped twice")]
    Duplicate { old: String },
    #[error("two GPUs of the image are mapped onto {new}")]
    Collision { new: String },
    #[error("cannot restore {old_name} state ({old}) onto {new_name} ({new}): GPUs must be of the same chip type")]
    ChipMismatch { old: String, old_name: String, new: String, new_name: String },
    #[error("the image's GPUs {} are not on this machine", .missing.join(", "))]
    Missing { missing: Vec<String>, available: Vec<String> },
    #[error("'{0}' is not a GPU UUID")]
    BadUuid(String),
}

impl GpuMapError {
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            GpuMapError::Missing { .. } => {
                Some("map each one onto a GPU of the same type here: --gpu-map OLD=NEW[,...] (UUIDs or indices; `hiber doctor` lists this machine's GPUs)")
            }
            GpuMapError::UnknownOld(_) => Some("`hiber inspect IMAGE` lists the image's GPUs"),
            GpuMapError::UnknownNew(_) => Some("`hiber doctor` lists this machine's GPUs"),
            _ => None,
        }
    }
}

/// Parses `OLD=NEW[,OLD=NEW...]`.
pub fn parse_gpu_map(s: &str) -> Result<Vec<(String, String)>, GpuMapError> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|pair| {
            let (old, new) = pair.split_once('=').ok_or_else(|| GpuMapError::Syntax(pair.to_string()))?;
            let (old, new) = (old.trim(), new.trim());
            if old.is_empty() || new.is_empty() {
                return Err(GpuMapError::Syntax(pair.to_string()));
            }
            Ok((old.to_string(), new.to_string()))
        })
        .collect()
}

fn find<'a>(gpus: &'a [Gpu], key: &str) -> Option<&'a Gpu> {
    match key.parse::<u32>() {
        Ok(i) => gpus.iter().find(|g| g.index == i),
        Err(_) => gpus.iter().find(|g| g.uuid.eq_ignore_ascii_case(key)),
    }
}

/// Resolves a user map against the image's GPUs (`recorded`) and this machine's (`here`).
///
/// Returns old UUID → new UUID for every GPU the image's processes `used`, or an empty
/// map when none was given and every used GPU is present (the driver then restores onto
/// the same GPUs).
pub fn resolve_gpu_map(map: &[(String, String)], recorded: &[Gpu], here: &[Gpu], used: &[&str]) -> Result<BTreeMap<String, String>, GpuMapError> {
    if map.is_empty() {
        let missing: Vec<String> =
            used.iter().filter(|u| !here.iter().any(|g| g.uuid == **u)).map(|u| u.to_string()).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        if !missing.is_empty() {
            return Err(GpuMapError::Missing { missing, available: here.iter().map(|g| format!("{} {}", g.index, g.uuid)).collect() });
        }
        return Ok(BTreeMap::new());
    }
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    for (old_key, new_key) in map {
        let old = find(recorded, old_key).ok_or_else(|| GpuMapError::UnknownOld(old_key.clone()))?;
        let new = find(here, new_key).ok_or_else(|| GpuMapError::UnknownNew(new_key.clone()))?;
        if old.name != new.name {
            return Err(GpuMapError::ChipMismatch { old: old.uuid.clone(), old_name: old.name.clone(), new: new.uuid.clone(), new_name: new.name.clone() });
        }
        if out.insert(old.uuid.clone(), new.uuid.clone()).is_some() {
            return Err(GpuMapError::Duplicate { old: old.uuid.clone() });
        }
    }
    // The driver wants every checkpointed GPU in the map once any is mapped.
    for u in used {
        if !out.contains_key(*u) {
            if !here.iter().any(|g| g.uuid == *u) {
                return Err(GpuMapError::Missing { missing: vec![u.to_string()], available: here.iter().map(|g| format!("{} {}", g.index, g.uuid)).collect() });
            }
            out.insert(u.to_string(), u.to_string());
        }
    }
    let mut targets: Vec<&String> = out.values().collect();
    targets.sort();
    if let Some(w) = targets.windows(2).find(|w| w[0] == w[1]) {
        return Err(GpuMapError::Collision { new: w[0].clone() });
    }
    Ok(out)
}

/// "GPU-8c6e4f0e-1d2b-..." → the 16 bytes of a `CUuuid`.
pub fn uuid_bytes(s: &str) -> Result<CuUuid, GpuMapError> {
    let hex: String = s.strip_prefix("GPU-").unwrap_or(s).chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(GpuMapError::BadUuid(s.to_string()));
    }
    let mut bytes = [0u8; 16];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| GpuMapError::BadUuid(s.to_string()))?;
    }
    Ok(CuUuid { bytes })
}
