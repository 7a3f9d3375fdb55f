//! Pools built through the metadata API must pass the real thin_check and
//! dump identically with thin_dump and `dmkit thin dump`.

use crate::thin_util;
use thin_util::*;

#[test]
fn empty_pool_passes_thin_check() {
    let s = Scratch::new("empty");
    let p = s.file("meta", 1024);
    drop(format_file(&p, 1000));
    assert_thin_check_clean(&p);
    {
        let theirs = thin_dump(&p, false);
        assert_eq!(theirs, our_dump(&p, false));
    }
}

#[test]
fn single_device_many_mappings() {
    let s = Scratch::new("single");
    let p = s.file("meta", 4096);
    let mut md = format_file(&p, 200_000);
    md.create_thin(0).unwrap();
    let mut model = Model::new();
    let e = model.entry(0).or_default();
    for v in 0..20_000u64 {
        let vb = (v * 7919) % 50_000;
        let b = md.alloc_data_block().unwrap();
        md.insert(0, vb, b).unwrap();
        e.insert(vb, (b, 0));
        if v % 5000 == 4999 {
            md.commit().unwrap();
        }
    }
    md.commit().unwrap();
    assert_eq!(md.mapped_blocks(0).unwrap(), e.len() as u64);
    assert_eq!(model_of_api(&mut md), model);
    drop(md);
    assert_thin_check_clean(&p);
    let ours = our_dump(&p, false);
    assert_eq!(model_of_xml(&ours), model);
    {
        let theirs = thin_dump(&p, false);
        assert_eq!(theirs, ours);
    }
}

/// Many devices, snapshots of snapshots, writes that break sharing, deletes,
/// a held metadata snapshot, several commits.
#[test]
fn snapshots_deletes_and_metadata_snap() {
    let s = Scratch::new("snaps");
    let p = s.file("meta", 65536);
    let mut md = format_file(&p, 400_000);
    let mut model = Model::new();
    let mut rng = Rng::new(42);
    // origin with 120k mappings (multi-level tree)
    md.create_thin(1).unwrap();
    let e = model.entry(1).or_default();
    for vb in 0..120_000u64 {
        let b = md.alloc_data_block().unwrap();
        md.insert(1, vb, b).unwrap();
        e.insert(vb, (b, 0));
    }
    md.commit().unwrap();
    // a chain of snapshots, each followed by writes to origin and snapshot
    let mut last = 1u64;
    for round in 0..6 {
        let snap = 2 + round;
        md.create_snap(snap, last).unwrap();
        let copy = model[&last].clone();
        model.insert(snap, copy);
        let t = md.time();
        for dev in [last, snap] {
            for _ in 0..2000 {
                let vb = rng.below(130_000);
                let b = md.alloc_data_block().unwrap();
                md.insert(dev, vb, b).unwrap();
                model.get_mut(&dev).unwrap().insert(vb, (b, t));
            }
            for _ in 0..500 {
                let vb = rng.below(130_000);
                let was = md.remove(dev, vb).unwrap();
                assert_eq!(was, model.get_mut(&dev).unwrap().remove(&vb).is_some());
            }
        }
        if round == 2 {
            md.reserve_metadata_snap().unwrap();
        }
        md.commit().unwrap();
        last = snap;
    }
    // shared-block detection: the origin's untouched blocks are shared
    let m = md.lookup(1, 119_999).unwrap();
    if let Some(m) = m {
        if m.time == 0 {
            assert!(m.shared);
        }
    }
    // delete a device in the middle of the chain and the origin
    md.delete(3).unwrap();
    model.remove(&3);
    md.delete(1).unwrap();
    model.remove(&1);
    md.commit().unwrap();
    for dev in md.devices() {
        assert_eq!(md.mapped_blocks(dev).unwrap(), model[&dev].len() as u64);
    }
    assert_eq!(model_of_api(&mut md), model);
    let held = md.held_root().expect("held");
    drop(md);
    assert_thin_check_clean(&p);
    {
        let (ok, out, err) = thin_check(&p, &["-m"]);
        assert!(ok && err.is_empty(), "thin_check -m: {out} {err}");
    }
    let ours = our_dump(&p, false);
    assert_eq!(model_of_xml(&ours), model);
    {
        let theirs = thin_dump(&p, false);
        assert_eq!(theirs, ours);
        assert_eq!(thin_dump(&p, true), our_dump(&p, true));
    }
    // release the metadata snapshot and reopen: still clean, same mappings
    let mut md = open_file(&p);
    assert_eq!(md.held_root(), Some(held));
    md.release_metadata_snap().unwrap();
    md.commit().unwrap();
    assert_eq!(model_of_api(&mut md), model);
    // deleting everything frees all data blocks
    for dev in md.devices() {
        md.delete(dev).unwrap();
    }
    md.commit().unwrap();
    assert_eq!(md.nr_free_data_blocks(), md.nr_data_blocks());
    drop(md);
    assert_thin_check_clean(&p);
}

/// Growing the data device and the metadata device (across bitmap
/// boundaries) keeps the pool valid, and the new space is usable.
#[test]
fn grow_data_and_metadata_devices() {
    let s = Scratch::new("grow");
    let p = s.file("meta", 1024);
    let mut md = format_file(&p, 10_000);
    md.create_thin(0).unwrap();
    for v in 0..10_000u64 {
        let b = md.alloc_data_block().unwrap();
        md.insert(0, v, b).unwrap();
    }
    assert!(md.alloc_data_block().is_err(), "data device should be full");
    md.abort().unwrap();
    md.create_thin(0).unwrap();
    md.resize_data_dev(40_000).unwrap();
    md.commit().unwrap();
    drop(md);
    assert_thin_check_clean(&p);

    // metadata device grows from 1024 to 40000 blocks (3 bitmaps)
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(40_000 * 4096)
        .unwrap();
    let mut md = open_file(&p);
    assert_eq!(md.nr_metadata_blocks(), 1024);
    md.resize_metadata_dev(40_000).unwrap();
    md.commit().unwrap();
    let mut model = Model::new();
    let e = model.entry(0).or_default();
    for v in 0..39_000u64 {
        let vb = v * 13 % 100_003;
        let b = md.alloc_data_block().unwrap();
        md.insert(0, vb, b).unwrap();
        e.insert(vb, (b, 0));
    }
    md.commit().unwrap();
    assert_eq!(md.nr_free_data_blocks(), 1_000);
    assert_eq!(model_of_api(&mut md), model);
    drop(md);
    assert_thin_check_clean(&p);
    assert_eq!(model_of_xml(&our_dump(&p, false)), model);
}
