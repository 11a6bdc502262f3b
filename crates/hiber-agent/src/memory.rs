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
use std::os::fd::{AsRawFd, IntoRawFd, OwnedFd};
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
    /// The driver handle the agent holds for the memory now (it changes when hiber hands
    /// memory back); the application never sees it (see [`app_handle`]).
    pub handle: Handle,
    pub size: usize,
    pub dev: c_int,
    /// Served by the agent: the requested size. The agent owns the reservation `maps[0]`
    /// and one handle reference; the application knows only the address.
    pub served: Option<usize>,
    /// References the application holds through its handle (create and retain count up,
    /// release counts down). Mappings keep the memory alive on their own.
    pub app_refs: u32,
    pub maps: Vec<Mapping>,
    /// Unmapped and released: hiber holds the memory.
    pub evacuated: bool,
    /// The descriptor hiber handed the memory back with. A handle imported from a
    /// descriptor cannot be exported again (the driver answers CUDA_ERROR_INVALID_VALUE),
    /// so the next checkpoint hands hiber a copy of this one. Closed when the memory is
    /// released (at that checkpoint, or when the application frees it).
    pub shared: Option<OwnedFd>,
}

/// Handles the agent gives the application for its own VMM allocations: a tag and the
/// entry's id. Driver handle values are reused once released, and the agent releases and
/// re-creates every handle at each checkpoint, so the application must never hold one.
const APP_HANDLE_TAG: u64 = 0x4842_0000_0000_0000;
const APP_HANDLE_MASK: u64 = 0xffff_0000_0000_0000;

pub fn app_handle(id: u64) -> Handle {
    APP_HANDLE_TAG | id
}

fn app_handle_id(h: Handle) -> Option<u64> {
    (h & APP_HANDLE_MASK == APP_HANDLE_TAG).then_some(h & !APP_HANDLE_MASK)
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
    granularity: HashMap<c_int, usize>,
    pub passthrough: Passthrough,
    /// Peer access the application enabled (`cuCtxEnablePeerAccess`), as (device whose
    /// memory is reached, device that reaches it). Served memory is VMM memory, which the
    /// driver opens to other devices only through `cuMemSetAccess`; the agent does that for
    /// the application, for memory served before and after the call.
    peers: Vec<(c_int, c_int)>,
    /// Memory the agent made for hiber to fill on restore ([`create_for`]), by allocation,
    /// until hiber hands it back.
    created: HashMap<u64, Handle>,
}

static TABLE: Mutex<Option<Table>> = Mutex::new(None);

pub fn table() -> MutexGuard<'static, Option<Table>> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn with<R>(f: impl FnOnce(&mut Table) -> R) -> R {
    let mut g = table();
    f(g.get_or_insert_with(Table::default))
}

fn round_up(n: usize, to: usize) -> Option<usize> {
    n.checked_next_multiple_of(to)
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
        if e.served.is_some() {
            self.served.insert(e.maps[0].va, e.id);
        }
        let id = e.id;
        self.entries.insert(id, e);
        id
    }

    fn remove(&mut self, id: u64) -> Option<Entry> {
        let e = self.entries.remove(&id)?;
        if e.served.is_some() {
            self.served.remove(&e.maps[0].va);
        }
        Some(e)
    }

    /// The served allocation containing `p`.
    pub fn served_containing(&self, p: DevPtr) -> Option<&Entry> {
        let (_, id) = self.served.range(..=p).next_back()?;
        let e = &self.entries[id];
        (p < e.maps[0].va.saturating_add(e.size as u64)).then_some(e)
    }

    /// The application's own allocation one of whose mappings contains `p`.
    fn app_entry_at(&mut self, p: DevPtr) -> Option<&mut Entry> {
        self.entries.values_mut().find(|e| e.served.is_none() && e.maps.iter().any(|m| p >= m.va && p < m.va.saturating_add(m.size as u64)))
    }

    /// The driver handle the application's `h` stands for (unknown handles pass unchanged:
    /// ones the application imported itself, say).
    pub fn translate(&self, h: Handle) -> Handle {
        app_handle_id(h).and_then(|id| self.entries.get(&id)).map(|e| e.handle).unwrap_or(h)
    }

    /// A new descriptor for the memory behind the application's handle `h`, when hiber
    /// handed that memory back (its driver handle, imported, cannot be exported again).
    pub fn shared_copy(&self, h: Handle) -> Option<c_int> {
        let e = self.entries.get(&app_handle_id(h)?)?;
        e.shared.as_ref()?.try_clone().ok().map(IntoRawFd::into_raw_fd)
    }

    pub fn tracked_bytes(&self) -> u64 {
        self.entries.values().map(|e| e.size as u64).sum()
    }

    /// Read-write access for `dev` and for every device the application let reach it.
    fn access_for(&self, dev: c_int) -> Vec<AccessDesc> {
        let peers = self.peers.iter().filter(|(owner, _)| *owner == dev).map(|&(_, by)| AccessDesc::read_write(by));
        std::iter::once(AccessDesc::read_write(dev)).chain(peers).collect()
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
    let Some(rsize) = round_up(size, gran) else { return Ok(None) };
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
    let access = with(|t| t.access_for(dev));
    if d.map(va, rsize, 0, h).and_then(|()| d.set_access(va, rsize, &access)).is_err() {
        let _ = d.unmap(va, rsize);
        let _ = d.release(h);
        let _ = d.free_reservation(va, rsize);
        return Ok(None);
    }
    with(|t| {
        // A peer enabled since the access was worked out (grant_peer did not see this
        // allocation yet) reaches it too.
        let mut access = access;
        for desc in t.access_for(dev) {
            if !access.iter().any(|a| a.location.is_device() && a.location.id == desc.location.id) && d.set_access(va, rsize, &[desc]).is_ok() {
                access.push(desc);
            }
        }
        t.insert(Entry {
            id: 0,
            handle: h,
            size: rsize,
            dev,
            served: Some(size),
            app_refs: 0,
            maps: vec![Mapping { va, size: rsize, offset: 0, access }],
            evacuated: false,
            shared: None,
        })
    });
    Ok(Some(va))
}

/// After the application's `cuCtxEnablePeerAccess` let device `by` reach `owner`'s memory:
/// served memory on `owner` (mapped now, served later, or brought back later) becomes
/// reachable from `by`. Every allocation is tried; the first error is returned.
pub fn grant_peer(d: &Driver, owner: c_int, by: c_int) -> Result<(), CuResult> {
    with(|t| {
        if !t.peers.contains(&(owner, by)) {
            t.peers.push((owner, by));
        }
        let mut first = Ok(());
        for e in t.entries.values_mut().filter(|e| e.served.is_some() && e.dev == owner && !e.evacuated) {
            for m in e.maps.iter_mut().filter(|m| !m.access.iter().any(|a| a.location.is_device() && a.location.id == by)) {
                let desc = AccessDesc::read_write(by);
                match d.set_access(m.va, m.size, &[desc]) {
                    Ok(()) => m.access.push(desc),
                    Err(r) => first = first.and(Err(r)),
                }
            }
        }
        first
    })
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
    let _ = d.synchronize_device(e.dev);
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

/// After the application's own `cuMemCreate` made `h` (exportable): the handle to give it.
pub fn track_created(h: Handle, size: usize, dev: c_int) -> Handle {
    with(|t| app_handle(t.insert(Entry { id: 0, handle: h, size, dev, served: None, app_refs: 1, maps: Vec::new(), evacuated: false, shared: None })))
}

/// After `cuMemRetainAllocationHandle(p)` gave the driver handle `h`: the handle to give
/// the application (its own allocations count one more reference; others pass).
pub fn track_retained(p: DevPtr, h: Handle) -> Handle {
    with(|t| match t.app_entry_at(p) {
        Some(e) => {
            e.app_refs += 1;
            app_handle(e.id)
        }
        None => h,
    })
}

/// After the application mapped its handle `app` at `[va, va+size)`.
pub fn track_mapped(va: DevPtr, size: usize, offset: usize, app: Handle) {
    with(|t| {
        if let Some(e) = app_handle_id(app).and_then(|id| t.entries.get_mut(&id)) {
            e.maps.push(Mapping { va, size, offset, access: Vec::new() });
        }
    });
}

/// After `cuMemSetAccess`: the access each mapping inside the range now has, merged per
/// location as the driver does.
pub fn track_access(va: DevPtr, size: usize, descs: &[AccessDesc]) {
    let end = va.saturating_add(size as u64);
    with(|t| {
        for e in t.entries.values_mut().filter(|e| e.served.is_none()) {
            for m in e.maps.iter_mut().filter(|m| m.va >= va && m.va < end) {
                for d in descs {
                    match m.access.iter_mut().find(|a| a.location.kind == d.location.kind && a.location.id == d.location.id) {
                        Some(a) => a.flags = d.flags,
                        None => m.access.push(*d),
                    }
                }
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
            if e.maps.is_empty() && e.app_refs == 0 {
                gone.push(e.id);
            }
        }
        for id in gone {
            t.remove(id);
        }
    });
}

/// `cuMemRelease` of the application's handle `app`. `None`: not one of the agent's.
pub fn release_app_handle(d: &Driver, app: Handle) -> Option<CuResult> {
    let id = app_handle_id(app)?;
    Some(with(|t| {
        let Some(e) = t.entries.get_mut(&id) else { return cuda::ERROR_INVALID_VALUE };
        if e.app_refs == 0 {
            return cuda::ERROR_INVALID_VALUE;
        }
        if let Err(r) = d.release(e.handle) {
            return r;
        }
        e.app_refs -= 1;
        if e.app_refs == 0 && e.maps.is_empty() {
            t.remove(id);
        }
        cuda::SUCCESS
    }))
}

/// A fresh descriptor for entry `e`'s memory. The application may have released its own
/// handle while keeping the memory mapped, so a reference is taken through a mapping.
pub fn export_fd(d: &Driver, e: &Entry) -> Result<c_int, CuResult> {
    if let Some(fd) = &e.shared {
        return fd.try_clone().map(IntoRawFd::into_raw_fd).map_err(|_| cuda::ERROR_OUT_OF_MEMORY);
    }
    if e.served.is_some() || e.maps.is_empty() {
        return d.export_fd(e.handle);
    }
    let h = d.retain(e.maps[0].va)?;
    let fd = d.export_fd(h);
    let _ = d.release(h);
    fd
}

/// Unmaps and releases every tracked allocation (hiber holds references to all of them).
/// Reservations stay. An allocation that fails is mapped back as it was; the ones done
/// before it stay evacuated, and hiber hands them back.
pub fn evacuate(d: &Driver) -> Result<(), (u64, CuResult)> {
    with(|t| {
        if t.entries.values().map(|e| e.dev).collect::<std::collections::BTreeSet<_>>().len() > 1 {
            crate::log(&format!("device ordinals at the release: {}", d.ordinals()));
        }
        for e in t.entries.values_mut().filter(|e| !e.evacuated) {
            let mut unmapped: Vec<&Mapping> = Vec::new();
            for m in &e.maps {
                if let Err(r) = d.unmap(m.va, m.size) {
                    for u in unmapped {
                        let _ = d.map(u.va, u.size, u.offset, e.handle).and_then(|()| d.set_access(u.va, u.size, &u.access));
                    }
                    return Err((e.id, r));
                }
                unmapped.push(m);
            }
            // Every reference in this process goes: the agent's (served) or the
            // application's (one per create or retain it has not released).
            let refs = if e.served.is_some() { 1 } else { e.app_refs };
            for _ in 0..refs {
                if let Err(r) = d.release(e.handle) {
                    crate::log(&format!("releasing allocation {}: CUDA error {r}", e.id));
                }
            }
            e.evacuated = true;
            e.shared = None;
        }
        Ok(())
    })
}

/// Maps the memory behind `fd` where entry `id` was, with the access it had.
///
/// On a restore onto other GPUs (`--gpu-map`) hiber created the memory on the GPU that the
/// entry's GPU maps onto, and the driver's restore gave the process's device ordinals the
/// same remapping: the entry's ordinal now names that GPU, so the recorded ordinals stay.
/// (Taking the ordinal from the location the driver reports for the imported handle
/// instead, as this did before, left a copy restored onto the other GPU of a 2×H200
/// machine unable to run its first kernel: CUDA_ERROR_INVALID_VALUE.)
/// Makes the memory of evacuated allocation `id` on the device the process knew it on, and a
/// descriptor for hiber to fill it through. Used on restore when the memory moves to a GPU
/// the process's `CUDA_VISIBLE_DEVICES` hid: hiber cannot make memory there that this
/// process can map (the driver answers CUDA_ERROR_NOT_INITIALIZED), but this process can,
/// on its own device ordinal, which the driver's restore has moved there.
pub fn create_for(d: &Driver, id: u64) -> Result<(usize, c_int, c_int), CuResult> {
    let (size, dev) = with(|t| t.entries.get(&id).filter(|e| e.evacuated).map(|e| (e.size, e.dev))).ok_or(cuda::ERROR_NOT_FOUND)?;
    let h = d.create(size, &AllocationProp::device(dev, cuda::HANDLE_TYPE_POSIX_FD))?;
    match d.export_fd(h) {
        Ok(fd) => {
            if let Some(old) = with(|t| t.created.insert(id, h)) {
                let _ = d.release(old);
            }
            Ok((size, dev, fd))
        }
        Err(r) => {
            let _ = d.release(h);
            Err(r)
        }
    }
}

/// Releases memory made for hiber ([`create_for`]) that it never handed back (its restore
/// failed): a later `load` must not map it unfilled.
pub fn drop_created(d: &Driver) {
    for h in with(|t| std::mem::take(&mut t.created)).into_values() {
        let _ = d.release(h);
    }
}

pub fn bring_back(d: &Driver, id: u64, fd: OwnedFd) -> Result<(), CuResult> {
    // Memory the agent made itself ([`create_for`]) is mapped through its own handle: the
    // driver refuses to import it again into a process that never saw its GPU (error 3),
    // though it let the process make it there.
    let h = match with(|t| t.created.remove(&id)) {
        Some(made) => made,
        None => d.import_fd(fd.as_raw_fd())?,
    };
    let reported = match d.properties(h) {
        Ok(p) if p.location.is_device() => p.location.id,
        _ => {
            let _ = d.release(h);
            return Err(cuda::ERROR_INVALID_VALUE);
        }
    };
    with(|t| {
        let peers = t.peers.clone();
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
        let dev = e.dev;
        if reported != dev {
            // Seen on 2×H200 after a restore with the GPUs swapped (and, for JAX, after an
            // in-place hand-back): the driver reports the location in the numbering the
            // process had before its restore, while cuDeviceGetUuid says its ordinals moved
            // with it. The mapping keeps the recorded ordinal; the ordinals' GPUs go with
            // the line, to tell that from memory on the wrong GPU.
            crate::log(&format!(
                "allocation {id}: the driver reports location {reported} for the imported memory, recorded on device {dev}; device ordinals now {}",
                d.ordinals()
            ));
        }
        // Peers enabled while the memory was away reach it too.
        let reach: Vec<c_int> = if e.served.is_some() { peers.iter().filter(|(owner, _)| *owner == dev).map(|&(_, by)| by).collect() } else { Vec::new() };
        let mut mapped: Vec<(DevPtr, usize)> = Vec::new();
        for m in e.maps.iter_mut() {
            for &by in &reach {
                if !m.access.iter().any(|a| a.location.is_device() && a.location.id == by) {
                    m.access.push(AccessDesc::read_write(by));
                }
            }
            if m.access.is_empty() {
                m.access.push(AccessDesc::read_write(dev));
            }
            if let Err(r) = d.map(m.va, m.size, m.offset, h).and_then(|()| {
                mapped.push((m.va, m.size));
                d.set_access(m.va, m.size, &m.access)
            }) {
                for (va, size) in mapped {
                    let _ = d.unmap(va, size);
                }
                let _ = d.release(h);
                return Err(r);
            }
        }
        // As many references as before the checkpoint: the agent's one (served), or the
        // application's count; with none, the mappings alone keep the memory.
        let refs = if e.served.is_some() { 1 } else { e.app_refs };
        if refs == 0 {
            let _ = d.release(h);
        } else if let Some(m) = e.maps.first() {
            for _ in 1..refs {
                let _ = d.retain(m.va);
            }
        }
        e.handle = h;
        e.evacuated = false;
        e.shared = Some(fd);
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
            app_refs: u32::from(!served),
            maps: vec![Mapping { va, size, offset: 0, access: Vec::new() }],
            evacuated: false,
            shared: None,
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
    fn the_application_holds_tagged_handles_that_translate_to_the_current_one() {
        let mut t = Table::default();
        let id = t.insert(entry(0x3000_0000, 0x20_0000, false));
        let app = app_handle(id);
        assert_eq!(t.translate(app), 0x3000_0001);
        // Memory handed back after a checkpoint has a new driver handle; the application's
        // stays the same, even if the driver reuses the old value for something else.
        t.entries.get_mut(&id).unwrap().handle = 0xdead;
        assert_eq!(t.translate(app), 0xdead);
        assert_eq!(t.translate(0x3000_0001), 0x3000_0001, "driver handles pass unchanged");
        assert_eq!(t.translate(42), 42);
        t.remove(id);
        assert_eq!(t.translate(app), app, "a stale handle reaches the driver, which refuses it");
    }

    #[test]
    fn served_memory_is_opened_to_the_peers_that_reach_its_device() {
        let t = Table { peers: vec![(0, 1), (1, 0), (0, 2)], ..Table::default() };
        let ids = |v: Vec<AccessDesc>| v.iter().map(|a| a.location.id).collect::<Vec<_>>();
        assert_eq!(ids(t.access_for(0)), vec![0, 1, 2], "the owner first, then each peer");
        assert_eq!(ids(t.access_for(1)), vec![1, 0]);
        assert_eq!(ids(t.access_for(3)), vec![3]);
    }

    #[test]
    fn access_merges_per_location() {
        with(|t| *t = Table::default());
        let id = with(|t| t.insert(entry(0x5000_0000, 0x20_0000, false)));
        track_access(0x5000_0000, 0x20_0000, &[AccessDesc::read_write(0)]);
        track_access(0x5000_0000, 0x20_0000, &[AccessDesc::read_write(1)]);
        track_access(0x5000_0000, 0x20_0000, &[AccessDesc { flags: 1, ..AccessDesc::read_write(1) }]);
        let access = with(|t| t.entries[&id].maps[0].access.clone());
        assert_eq!(access.len(), 2, "granting a peer keeps the owner's access");
        assert_eq!((access[0].location.id, access[0].flags), (0, hiber_cuda_sys::CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
        assert_eq!((access[1].location.id, access[1].flags), (1, 1));
        with(|t| *t = Table::default());
    }

    #[test]
    fn round_up_to_granules() {
        assert_eq!(round_up(1, 2 << 20), Some(2 << 20));
        assert_eq!(round_up(2 << 20, 2 << 20), Some(2 << 20));
        assert_eq!(round_up((2 << 20) + 1, 2 << 20), Some(4 << 20));
        assert_eq!(round_up(usize::MAX, 2 << 20), None);
    }
}
