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
    #[error("the image's processes used {used} GPUs ({name}); this machine has {here} of that type")]
    TooFew { used: usize, here: usize, name: String },
    #[error("'{0}' is not a GPU UUID")]
    BadUuid(String),
}

impl GpuMapError {
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            GpuMapError::Missing { .. } => {
                Some("map each one onto a GPU of the same type here: --gpu-map OLD=NEW[,...] (UUIDs or indices; `hiber doctor` lists this machine's GPUs)")
            }
            GpuMapError::TooFew { .. } => Some("a job restores onto as many GPUs as it used: restore it on a machine with that many of that type"),
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
        if let Some(name) = missing.iter().find_map(|m| recorded.iter().find(|r| &r.uuid == m).map(|r| &r.name)) {
            if let Some(e) = too_few(name, recorded, here, used) {
                return Err(e);
            }
        }
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
    complete(&mut out, recorded, here, used)?;
    Ok(out)
}

/// Completes a user's map into what the driver takes (CUDA 13.0 / r580).
///
/// The rules of `cuCheckpointProcessRestore`'s `gpuPairs`: cuda.h says the array "must
/// contain every checkpointed GPU", each target "of the same chip type" with enough memory.
/// In practice (driver 580; NVIDIA/cuda-checkpoint#35, where `-d U0=U1` alone fails with
/// CUDA_ERROR_INVALID_VALUE and `U0=U1,U1=U0` works) the pairs must form a bijection over
/// the machine's GPUs, not only those the process used: a map that moves GPU 0 onto GPU 1
/// of a two-GPU machine must also say where GPU 1 goes. That holds for a process whose
/// `CUDA_VISIBLE_DEVICES` hid GPUs, too: on 2×H200 the driver refused a job started with
/// `CUDA_VISIBLE_DEVICES=1`, mapped 1=0, the one pair of the GPU it could see, and
/// restored it with both.
///
/// Every GPU of the image's machine that the user left out keeps its own UUID when that
/// is here and no other GPU moves onto it; else it takes the first GPU here, by index, of
/// the same type that nothing else was mapped onto. A GPU the image's processes used that
/// finds no place is an error; an unused one is left out (a process that could see it
/// cannot then be restored, and the driver says so).
fn complete(out: &mut BTreeMap<String, String>, recorded: &[Gpu], here: &[Gpu], used: &[&str]) -> Result<(), GpuMapError> {
    let mut left: Vec<&Gpu> = recorded.iter().filter(|g| !out.contains_key(&g.uuid)).collect();
    // Used GPUs that are not on the image's list (an older image) are completed too.
    let extra: Vec<Gpu> = used
        .iter()
        .filter(|u| !recorded.iter().any(|g| g.uuid == **u) && !out.contains_key(**u))
        .map(|u| Gpu {
            index: u32::MAX,
            uuid: u.to_string(),
            name: here.iter().find(|g| g.uuid == *u).map(|g| g.name.clone()).unwrap_or_default(),
            memory_total: 0,
            memory_free: 0,
        })
        .collect();
    left.extend(extra.iter());
    // GPUs the processes used take free GPUs before those they did not.
    left.sort_by_key(|g| !used.contains(&g.uuid.as_str()));
    let taken = |out: &BTreeMap<String, String>, uuid: &str| out.values().any(|v| v == uuid);
    // Identity first, so that a GPU moves only where it must.
    left.retain(|g| {
        if here.iter().any(|h| h.uuid == g.uuid) && !taken(out, &g.uuid) {
            out.insert(g.uuid.clone(), g.uuid.clone());
            false
        } else {
            true
        }
    });
    let mut free: Vec<&Gpu> = here.iter().collect();
    free.sort_by_key(|g| g.index);
    for g in left {
        match free.iter().find(|h| h.name == g.name && !taken(out, &h.uuid)) {
            Some(h) => {
                out.insert(g.uuid.clone(), h.uuid.clone());
            }
            None if used.contains(&g.uuid.as_str()) => {
                if let Some(e) = too_few(&g.name, recorded, here, used) {
                    return Err(e);
                }
                return Err(GpuMapError::Missing {
                    missing: vec![g.uuid.clone()],
                    available: here.iter().map(|g| format!("{} {}", g.index, g.uuid)).collect(),
                });
            }
            None => {}
        }
    }
    let mut targets: Vec<&String> = out.values().collect();
    targets.sort();
    if let Some(w) = targets.windows(2).find(|w| w[0] == w[1]) {
        return Err(GpuMapError::Collision { new: w[0].clone() });
    }
    Ok(())
}

/// The refusal of an image whose processes used more GPUs of type `name` than this machine
/// has (none of the type is a question of which GPU, not how many).
fn too_few(name: &str, recorded: &[Gpu], here: &[Gpu], used: &[&str]) -> Option<GpuMapError> {
    let here_n = here.iter().filter(|h| h.name == name).count();
    let used_n = recorded.iter().filter(|r| r.name == name && used.contains(&r.uuid.as_str())).count();
    (here_n > 0 && used_n > here_n).then(|| GpuMapError::TooFew { used: used_n, here: here_n, name: name.to_string() })
}

/// The GPUs a process can see, by UUID, from its `CUDA_VISIBLE_DEVICES` (`None`: unset, so
/// every GPU of the machine). Entries are indices (in NVML's order, which is CUDA's on a
/// machine of one GPU type) or UUIDs or unique UUID prefixes; as in CUDA, the list ends at
/// the first entry that names no GPU.
pub fn visible_gpus(value: Option<&str>, gpus: &[Gpu]) -> Vec<String> {
    let Some(value) = value else { return gpus.iter().map(|g| g.uuid.clone()).collect() };
    let mut out = Vec::new();
    for item in value.split(',').map(str::trim) {
        let found = match item.parse::<u32>() {
            Ok(i) => gpus.iter().find(|g| g.index == i),
            Err(_) if item.starts_with("GPU-") => {
                let mut m = gpus.iter().filter(|g| g.uuid.to_ascii_lowercase().starts_with(&item.to_ascii_lowercase()));
                match (m.next(), m.next()) {
                    (Some(g), None) => Some(g),
                    _ => None,
                }
            }
            Err(_) => None,
        };
        match found {
            Some(g) if !out.contains(&g.uuid) => out.push(g.uuid.clone()),
            Some(_) => {}
            None => break,
        }
    }
    out
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
