//! Device memory the agent tracks: allocations it serves from VMM reservations it owns
//! (`cuMemAlloc` and friends), and VMM allocations the application makes itself
//! (`cuMemCreate` + `cuMemMap`, as PyTorch's expandable segments do).
//!
//! Both kinds are physical allocations created exportable as POSIX file descriptors. At
//! checkpoint hiber takes a reference to each through its descriptor, the agent unmaps
//! and releases its own, and the virtual ranges stay reserved; afterwards the agent maps
//! whatever physical memory hiber hands back at the very same addresses. Handle values
//! change across that, so the application's handles are translated.

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_int;
use std::sync::{Mutex, MutexGuard};

use crate::cuda::{self, AccessDesc, AllocationProp, CuResult, DevPtr, Driver, Handle};

/// Requests below this size fall through to the driver: a VMM allocation takes at least
/// a granule (2 MiB), and small buffers are cheap for the driver's checkpoint anyway.
pub const SERVE_MIN: usize = 2 << 20;

#[derive(Debug, Clone)]
pub struct Mapping {
    pub va: DevPtr,
    pub size: usize,
    pub offset: usize,
    pub access: Vec<AccessDesc>,
}

#[derive(Debug)]
pub struct Entry {
    pub id: u64,
    /// The handle that owns the memory now (changes when hiber hands memory back).
    pub handle: Handle,
    pub size: usize,
    pub dev: c_int,
    /// Served by the agent: it owns the reservation `maps[0]` and the handle; the
    /// application knows only the address.
    pub served: Option<usize>,
    /// The application still holds its handle (not yet `cuMemRelease`d).
    pub app_holds: bool,
    pub maps: Vec<Mapping>,
    /// Unmapped and released: hiber holds the memory.
    pub evacuated: bool,
}

#[derive(Debug, Default)]
pub struct Passthrough {
    pub calls: u64,
    pub bytes: u64,
    pub small: u64,
    pub pitch: u64,
    pub stream_ordered: u64,
    pub managed: u64,
    pub vmm_not_exportable: u64,
}

#[derive(Debug, Default)]
pub struct Table {
    next_id: u64,
    pub entries: BTreeMap<u64, Entry>,
    /// Base address → id, for served allocations.
    served: BTreeMap<DevPtr, u64>,
    /// Any handle value the application may use (its original or the current one) → id.
    handles: HashMap<Handle, u64>,
    granularity: HashMap<c_int, usize>,
    pub passthrough: Passthrough,
}

static TABLE: Mutex<Option<Table>> = Mutex::new(None);

pub fn table() -> MutexGuard<'static, Option<Table>> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn with<R>(f: impl FnOnce(&mut Table) -> R) -> R {
    let mut g = table();
    f(g.get_or_insert_with(Table::default))
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

impl Table {
    fn granularity(&mut self, d: &Driver, dev: c_int) -> Result<usize, CuResult> {
        if let Some(g) = self.granularity.get(&dev) {
            return Ok(*g);
        }
        let g = d.granularity(dev)?;
        self.granularity.insert(dev, g);
        Ok(g)
    }

    fn insert(&mut self, mut e: Entry) -> u64 {
        self.next_id += 1;
        e.id = self.next_id;
        self.handles.insert(e.handle, e.id);
        if e.served.is_some() {
            self.served.insert(e.maps[0].va, e.id);
        }
        let id = e.id;
        self.entries.insert(id, e);
        id
    }

    fn remove(&mut self, id: u64) -> Option<Entry> {
        let e = self.entries.remove(&id)?;
        self.handles.retain(|_, v| *v != id);
        if e.served.is_some() {
            self.served.remove(&e.maps[0].va);
        }
        Some(e)
    }

    /// The served allocation containing `p`.
    pub fn served_containing(&self, p: DevPtr) -> Option<&Entry> {
        let (_, id) = self.served.range(..=p).next_back()?;
        let e = &self.entries[id];
        (p < e.maps[0].va + e.size as u64).then_some(e)
    }

    /// The handle the application's `h` stands for now.
    pub fn translate(&self, h: Handle) -> Handle {
        self.handles.get(&h).and_then(|id| self.entries.get(id)).map(|e| e.handle).unwrap_or(h)
    }

    pub fn tracked_bytes(&self) -> u64 {
        self.entries.values().map(|e| e.size as u64).sum()
    }

    pub fn devices(&self) -> Vec<c_int> {
        let mut d: Vec<c_int> = self.entries.values().map(|e| e.dev).collect();
        d.sort_unstable();
        d.dedup();
        d
    }
}

/// `cuMemAlloc` from a reservation of the agent's own. `Ok(None)`: not served, fall
/// through to the driver.
pub fn serve(d: &Driver, size: usize) -> Result<Option<DevPtr>, CuResult> {
    if size < SERVE_MIN {
        return Ok(None);
    }
    let Some((_ctx, dev)) = d.current_device() else { return Ok(None) };
    let Ok(gran) = with(|t| t.granularity(d, dev)) else { return Ok(None) };
    let rsize = round_up(size, gran);
    let Ok(va) = d.reserve(rsize) else { return Ok(None) };
    let prop = AllocationProp::device(dev, cuda::HANDLE_TYPE_POSIX_FD);
    let h = match d.create(rsize, &prop) {
        Ok(h) => h,
        Err(e) => {
            let _ = d.free_reservation(va, rsize);
            // Out of memory is the answer cuMemAlloc would give too; anything else
            // (VMM unsupported here) falls through.
            return if e == cuda::ERROR_OUT_OF_MEMORY { Err(e) } else { Ok(None) };
        }
    };
    let access = vec![AccessDesc::read_write(dev)];
    if d.map(va, rsize, 0, h).and_then(|()| d.set_access(va, rsize, &access)).is_err() {
        let _ = d.unmap(va, rsize);
        let _ = d.release(h);
        let _ = d.free_reservation(va, rsize);
        return Ok(None);
    }
    with(|t| {
        t.insert(Entry {
            id: 0,
            handle: h,
            size: rsize,
            dev,
            served: Some(size),
            app_holds: false,
            maps: vec![Mapping { va, size: rsize, offset: 0, access }],
            evacuated: false,
        })
    });
    Ok(Some(va))
}

/// `cuMemFree` of a served allocation. `None`: not the agent's, the driver answers.
pub fn free_served(d: &Driver, p: DevPtr) -> Option<CuResult> {
    let e = with(|t| {
        let id = *t.served.get(&p)?;
        t.remove(id)
    });
    let Some(e) = e else {
        // An interior pointer of a served allocation is as invalid as for cuMemFree.
        return with(|t| t.served_containing(p).is_some()).then_some(cuda::ERROR_INVALID_VALUE);
    };
    // cuMemFree waits for the device; unmapping memory a kernel still uses would not.
    let _ = d.synchronize_current();
    let m = &e.maps[0];
    let mut r = d.unmap(m.va, m.size);
    if !e.evacuated {
        r = r.and(d.release(e.handle));
    }
    r = r.and(d.free_reservation(m.va, m.size));
    Some(r.err().unwrap_or(cuda::SUCCESS))
}

/// The base and requested size of the served allocation holding `p`.
pub fn served_range(p: DevPtr) -> Option<(DevPtr, usize)> {
    with(|t| t.served_containing(p).map(|e| (e.maps[0].va, e.served.unwrap_or(e.size))))
}

/// After the application's own `cuMemCreate` succeeded with an exportable handle.
pub fn track_created(h: Handle, size: usize, dev: c_int) {
    with(|t| {
        t.insert(Entry { id: 0, handle: h, size, dev, served: None, app_holds: true, maps: Vec::new(), evacuated: false });
    });
}

pub fn track_mapped(va: DevPtr, size: usize, offset: usize, h: Handle) {
    with(|t| {
        if let Some(id) = t.handles.get(&h).copied() {
            if let Some(e) = t.entries.get_mut(&id) {
                e.maps.push(Mapping { va, size, offset, access: Vec::new() });
            }
        }
    });
}

pub fn track_access(va: DevPtr, size: usize, descs: &[AccessDesc]) {
    let end = va.saturating_add(size as u64);
    with(|t| {
        for e in t.entries.values_mut().filter(|e| e.served.is_none()) {
            for m in e.maps.iter_mut().filter(|m| m.va >= va && m.va < end) {
                m.access = descs.to_vec();
            }
        }
    });
}

/// After `cuMemUnmap` of `[va, va+size)`: drops the mappings inside, and entries whose
/// memory is now gone.
pub fn track_unmapped(va: DevPtr, size: usize) {
    let end = va.saturating_add(size as u64);
    with(|t| {
        let mut gone = Vec::new();
        for e in t.entries.values_mut().filter(|e| e.served.is_none()) {
            e.maps.retain(|m| !(m.va >= va && m.va < end));
            if e.maps.is_empty() && !e.app_holds {
                gone.push(e.id);
            }
        }
        for id in gone {
            t.remove(id);
        }
    });
}

/// After the application's `cuMemRelease(h)`.
pub fn track_released(h: Handle) {
    with(|t| {
        let Some(id) = t.handles.get(&h).copied() else { return };
        let gone = match t.entries.get_mut(&id) {
            Some(e) => {
                e.app_holds = false;
                e.maps.is_empty()
            }
            None => false,
        };
        if gone {
            t.remove(id);
        }
    });
}

/// Unmaps and releases every tracked allocation (hiber holds references to all of them).
/// Reservations stay. On error the ones done so far stay evacuated; hiber hands them back.
pub fn evacuate(d: &Driver) -> Result<(), (u64, CuResult)> {
    with(|t| {
        for e in t.entries.values_mut().filter(|e| !e.evacuated) {
            for m in &e.maps {
                d.unmap(m.va, m.size).map_err(|r| (e.id, r))?;
            }
            if e.served.is_some() || e.app_holds {
                d.release(e.handle).map_err(|r| (e.id, r))?;
            }
            e.evacuated = true;
        }
        Ok(())
    })
}

/// Maps the memory behind `fd` where entry `id` was. Its device may have changed (a
/// restore onto another GPU): access is granted there.
pub fn bring_back(d: &Driver, id: u64, fd: c_int) -> Result<(), CuResult> {
    let h = d.import_fd(fd)?;
    let dev = match d.properties(h) {
        Ok(p) if p.is_device() => p.location.id,
        _ => {
            let _ = d.release(h);
            return Err(cuda::ERROR_INVALID_VALUE);
        }
    };
    with(|t| {
        let Some(e) = t.entries.get_mut(&id) else {
            let _ = d.release(h);
            return Err(cuda::ERROR_NOT_FOUND);
        };
        if !e.evacuated {
            // Never released (hiber is undoing a checkpoint that failed before): the
            // application's memory is still mapped; nothing to do.
            let _ = d.release(h);
            return Ok(());
        }
        let old_dev = e.dev;
        for m in e.maps.iter_mut() {
            for a in m.access.iter_mut().filter(|a| a.location.id == old_dev) {
                a.location.id = dev;
            }
            if m.access.is_empty() {
                m.access.push(AccessDesc::read_write(dev));
            }
            if let Err(r) = d.map(m.va, m.size, m.offset, h).and_then(|()| d.set_access(m.va, m.size, &m.access)) {
                let _ = d.unmap(m.va, m.size);
                let _ = d.release(h);
                return Err(r);
            }
        }
        // The agent (served) or the application keeps this reference; otherwise the
        // mappings alone keep the memory, as before the checkpoint.
        if e.served.is_none() && !e.app_holds {
            let _ = d.release(h);
        }
        e.handle = h;
        e.dev = dev;
        e.evacuated = false;
        t.handles.insert(h, id);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(va: DevPtr, size: usize, served: bool) -> Entry {
        Entry {
            id: 0,
            handle: va + 1,
            size,
            dev: 0,
            served: served.then_some(size - 100),
            app_holds: !served,
            maps: vec![Mapping { va, size, offset: 0, access: Vec::new() }],
            evacuated: false,
        }
    }

    #[test]
    fn served_lookup_finds_the_containing_allocation_only() {
        let mut t = Table::default();
        t.insert(entry(0x1000_0000, 0x20_0000, true));
        t.insert(entry(0x2000_0000, 0x40_0000, true));
        assert_eq!(t.served_containing(0x1000_0000).unwrap().maps[0].va, 0x1000_0000);
        assert_eq!(t.served_containing(0x101f_ffff).unwrap().maps[0].va, 0x1000_0000);
        assert!(t.served_containing(0x1020_0000).is_none());
        assert!(t.served_containing(0x0fff_ffff).is_none());
        assert_eq!(t.served_containing(0x2000_0010).unwrap().maps[0].va, 0x2000_0000);
        assert_eq!(t.tracked_bytes(), 0x60_0000);
    }

    #[test]
    fn handles_translate_after_memory_comes_back() {
        let mut t = Table::default();
        let id = t.insert(entry(0x3000_0000, 0x20_0000, false));
        let old = t.entries[&id].handle;
        assert_eq!(t.translate(old), old);
        t.entries.get_mut(&id).unwrap().handle = 0xdead;
        t.handles.insert(0xdead, id);
        assert_eq!(t.translate(old), 0xdead, "the application's old handle names the new memory");
        assert_eq!(t.translate(0xdead), 0xdead);
        assert_eq!(t.translate(42), 42, "unknown handles pass unchanged");
        t.remove(id);
        assert_eq!(t.translate(old), old);
    }

    #[test]
    fn round_up_to_granules() {
        assert_eq!(round_up(1, 2 << 20), 2 << 20);
        assert_eq!(round_up(2 << 20, 2 << 20), 2 << 20);
        assert_eq!(round_up((2 << 20) + 1, 2 << 20), 4 << 20);
    }
}
