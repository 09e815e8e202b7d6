//! The `rans_classes` value codec (docs/format.md §6.3): the values of a tensor with `context` positions, coded
//! with a `rans` stream per group of the base's exponent classes.
//!
//! An optimizer's step moves small weights by more steps of their bit pattern than large ones (the step has about
//! the same size for every weight, the spacing of a float is relative to its magnitude), so the differences of
//! one class are far more alike than those of the whole tensor. Both ends know every change's class (from the
//! base, as the positions), so the writer splits the classes into consecutive groups and codes each group's values
//! with its own frequency table; it picks the groups that make the stream smallest, tables included.

use super::context::CLASSES;
use super::rans::{self, RansReader, Tokens, MAX_TOKENS};
use super::varint;

/// A group's stream header beside its table: the first class (one byte), its value count and stream length
/// (varints, usually one or two bytes each), as the writer estimates it.
const GROUP_HEADER_BYTES: f64 = 4.0;

/// The parsed header: groups' first classes, value counts and streams.
struct Groups<'a> {
    /// The group of every class.
    group_of: [u8; CLASSES],
    counts: Vec<u64>,
    streams: Vec<&'a [u8]>,
}

/// The group of every class, for groups starting at the ascending classes `starts` (the first 0).
fn group_of(starts: &[usize]) -> [u8; CLASSES] {
    let mut group_of = [0u8; CLASSES];
    for (group, window) in starts.iter().chain([&CLASSES]).collect::<Vec<_>>().windows(2).enumerate() {
        group_of[*window[0]..*window[1]].fill(group as u8);
    }
    group_of
}

fn read_groups(bytes: &[u8], changed: u64) -> Result<Groups<'_>, String> {
    let fail = |what: &str| format!("rans_classes stream: {what}");
    let groups = usize::from(*bytes.first().ok_or_else(|| fail("it is empty"))?);
    if !(1..=CLASSES).contains(&groups) {
        return Err(fail(&format!("{groups} groups (1 to {CLASSES})")));
    }
    let mut at = 1usize;
    let mut starts = vec![0usize];
    for _ in 1..groups {
        let start = usize::from(*bytes.get(at).ok_or_else(|| fail("a group's first class is missing"))?);
        at += 1;
        if start <= *starts.last().expect("group 0") || start >= CLASSES {
            return Err(fail(&format!("group first classes {starts:?} then {start}: not increasing within 1..15")));
        }
        starts.push(start);
    }
    let group_of = group_of(&starts);
    let (mut counts, mut lens) = (Vec::with_capacity(groups), Vec::with_capacity(groups));
    for group in 0..groups {
        let count = varint::read(bytes, &mut at).map_err(|_| fail(&format!("group {group}'s count is cut")))?;
        let len = varint::read(bytes, &mut at).map_err(|_| fail(&format!("group {group}'s length is cut")))?;
        if (count == 0) != (len == 0) {
            return Err(fail(&format!("group {group} has {count} values in {len} bytes")));
        }
        counts.push(count);
        lens.push(len);
    }
    let total = counts.iter().try_fold(0u64, |sum, &c| sum.checked_add(c)).ok_or_else(|| fail("counts overflow"))?;
    if total != changed {
        return Err(fail(&format!("its groups hold {total} values but the record says changed={changed}")));
    }
    let bytes_left = (bytes.len() - at) as u64;
    if lens.iter().try_fold(0u64, |sum, &l| sum.checked_add(l)) != Some(bytes_left) {
        return Err(fail(&format!("its groups' lengths {lens:?} do not add up to the {bytes_left} bytes after them")));
    }
    let mut streams = Vec::with_capacity(groups);
    for len in lens {
        streams.push(&bytes[at..at + len as usize]);
        at += len as usize;
    }
    Ok(Groups { group_of, counts, streams })
}

/// Checks a stream without the base: its header, and every group's `rans` stream to hold exactly its count.
pub fn check<const W: usize>(bytes: &[u8], changed: u64) -> Result<(), String> {
    let groups = read_groups(bytes, changed)?;
    for (group, (&count, stream)) in groups.counts.iter().zip(&groups.streams).enumerate() {
        if count > 0 {
            rans::check_rans::<W>(stream, count).map_err(|e| format!("rans_classes group {group}: {e}"))?;
        }
    }
    Ok(())
}

/// Every group's values, each group's in change order, decoded without the classes (for a reader that finds the
/// class of each change itself): the group of every class, and the values of each group. Checks every stream.
pub fn by_group<const W: usize>(bytes: &[u8], changed: u64) -> Result<([u8; CLASSES], Vec<Vec<u64>>), String> {
    let groups = read_groups(bytes, changed)?;
    let mut out = Vec::with_capacity(groups.streams.len());
    for (group, (&count, stream)) in groups.counts.iter().zip(&groups.streams).enumerate() {
        let mut values = super::zeroed_values(count)?;
        if count > 0 {
            let fail = |e: String| format!("rans_classes group {group}: {e}");
            let mut reader = RansReader::new(stream, W).map_err(fail)?;
            reader.read_values::<W>(&mut values).map_err(fail)?;
            if !reader.is_exhausted() {
                return Err(fail("its stream has bytes after its last value".to_owned()));
            }
        }
        out.push(values);
    }
    Ok((groups.group_of, out))
}

/// The values in change order, `classes[i]` being change `i`'s class: each from its group's stream, in turn.
/// Fails where a group's count differs from its classes' changes or a stream is bad.
pub fn decode<const W: usize>(bytes: &[u8], classes: &[u8]) -> Result<Vec<u64>, String> {
    let groups = read_groups(bytes, classes.len() as u64)?;
    let mut readers = Vec::with_capacity(groups.streams.len());
    for stream in &groups.streams {
        readers.push(if stream.is_empty() { None } else { Some(RansReader::new(stream, W)?) });
    }
    let mut left = groups.counts.clone();
    let mut out = Vec::with_capacity(classes.len());
    for &class in classes {
        let group = usize::from(groups.group_of[usize::from(class)]);
        let reader = match (left[group], readers[group].as_mut()) {
            (1.., Some(reader)) => reader,
            _ => {
                return Err(format!(
                    "rans_classes stream: group {group} holds {} values, fewer than its classes' changes",
                    groups.counts[group]
                ))
            }
        };
        left[group] -= 1;
        out.push(reader.next_value::<W>()?);
    }
    // Counts add up to the changes and none ran out, so every group is used up: each stream must end there.
    if readers.iter().flatten().any(|reader| !reader.is_exhausted()) {
        return Err("rans_classes stream: a group's stream has bytes after its last value".to_owned());
    }
    Ok(out)
}

/// The token counts of each class's differences (`width`-byte elements), and each difference's token and low bits.
fn tokenize(classes: &[u8], differences: &[u64], width: usize) -> (Vec<[u64; MAX_TOKENS]>, Vec<(u8, u64)>) {
    let mut histograms = vec![[0u64; MAX_TOKENS]; CLASSES];
    let mut tokens = Vec::with_capacity(differences.len());
    for (&class, &difference) in classes.iter().zip(differences) {
        let u = rans::code_of(difference, width);
        let (token, bits) = rans::token_of(u);
        histograms[usize::from(class)][usize::from(token)] += 1;
        tokens.push((token, u & ((1u64 << bits) - 1)));
    }
    (histograms, tokens)
}

/// Estimated bytes of one group's stream, table and header for these token counts (0 values: the header alone),
/// leaving out the low bits, which cost the same however the classes are grouped: the counts' information content
/// and about a byte and a half per table entry.
fn group_cost(histogram: &[u64]) -> f64 {
    let total: u64 = histogram.iter().sum();
    if total == 0 {
        return GROUP_HEADER_BYTES;
    }
    let (mut bits, mut used) = (0f64, 0usize);
    for &count in histogram.iter().filter(|&&c| c > 0) {
        bits += count as f64 * (total as f64 / count as f64).log2();
        used += 1;
    }
    GROUP_HEADER_BYTES + 9.0 + 1.5 * used as f64 + bits / 8.0
}

/// The stream of `differences` (wrapping differences of `width`-byte elements, in change order), `classes[i]`
/// being change `i`'s class; None where a single group is best (plain `rans` is then smaller by its header).
pub fn encode(classes: &[u8], differences: &[u64], width: usize) -> Option<Vec<u8>> {
    assert_eq!(classes.len(), differences.len(), "one class per difference");
    if differences.is_empty() {
        return None;
    }
    let (histograms, tokens) = tokenize(classes, differences, width);
    let used = rans::token_count(width);
    // Token counts of classes 0..c, so that a run of classes costs one subtraction per token.
    let mut prefix = vec![[0u64; MAX_TOKENS]; CLASSES + 1];
    for class in 0..CLASSES {
        for token in 0..used {
            prefix[class + 1][token] = prefix[class][token] + histograms[class][token];
        }
    }
    let merged = |a: usize, b: usize| {
        let mut sum = [0u64; MAX_TOKENS];
        for token in 0..used {
            sum[token] = prefix[b][token] - prefix[a][token];
        }
        sum
    };
    // The cheapest split of the classes into consecutive groups: best[b] is the least cost of classes 0..b, and
    // cut[b] where its last group starts.
    let (mut best, mut cut) = (vec![0f64; CLASSES + 1], vec![0usize; CLASSES + 1]);
    for b in 1..=CLASSES {
        best[b] = f64::INFINITY;
        for a in 0..b {
            let cost = best[a] + group_cost(&merged(a, b)[..used]);
            if cost < best[b] {
                (best[b], cut[b]) = (cost, a);
            }
        }
    }
    let mut starts = vec![];
    let mut b = CLASSES;
    while b > 0 {
        starts.push(cut[b]);
        b = cut[b];
    }
    starts.reverse();
    if starts.len() == 1 {
        return None;
    }
    let group_of = group_of(&starts);
    let mut parts: Vec<Tokens> = (0..starts.len()).map(|_| Tokens::default()).collect();
    for (&class, &(token, low)) in classes.iter().zip(&tokens) {
        let part = &mut parts[usize::from(group_of[usize::from(class)])];
        part.tokens.push(token);
        if token >= 16 {
            part.low_bits.push(low);
        }
    }
    let mut out = vec![starts.len() as u8];
    out.extend(starts[1..].iter().map(|&start| start as u8));
    let mut streams = Vec::with_capacity(parts.len());
    for (group, part) in parts.iter().enumerate() {
        let stream = if part.tokens.is_empty() {
            Vec::new()
        } else {
            rans::encode(&[part], &rans::normalise(&merged(starts[group], *starts.get(group + 1).unwrap_or(&CLASSES))))
        };
        varint::write(&mut out, part.tokens.len() as u64);
        varint::write(&mut out, stream.len() as u64);
        streams.push(stream);
    }
    for stream in streams {
        out.extend_from_slice(&stream);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::testing::xorshift;

    /// Classes whose differences grow with the class (as small weights move by more steps), and their values.
    fn sample(n: usize, seed: u64) -> (Vec<u8>, Vec<u64>) {
        let mut next = xorshift(seed | 1);
        let (mut classes, mut values) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let r = next();
            let class = (4 + r % 9) as u8;
            let magnitude = 1 + (next() % (1 + 3 * u64::from(class.saturating_sub(6)))) as i64;
            let signed = if r >> 40 & 1 == 1 { magnitude } else { -magnitude };
            classes.push(class);
            values.push(signed as u64 & 0xffff);
        }
        (classes, values)
    }

    #[test]
    fn roundtrips_and_beats_one_table() {
        let (classes, values) = sample(20_000, 7);
        let stream = encode(&classes, &values, 2).expect("several groups pay here");
        check::<2>(&stream, values.len() as u64).unwrap();
        assert_eq!(decode::<2>(&stream, &classes).unwrap(), values);
        let (histogram, _) = tokenize(&vec![0; values.len()], &values, 2);
        let one = rans::estimated_len(&histogram[0], &rans::normalise(&histogram[0]));
        assert!((stream.len() as f64) < 0.9 * one, "{} bytes against {one:.0} with one table", stream.len());
    }

    #[test]
    fn one_group_is_left_to_plain_rans() {
        let values: Vec<u64> = (0..5000u64).map(|i| if i % 3 == 0 { 1 } else { 0xffff }).collect();
        assert!(encode(&vec![8u8; values.len()], &values, 2).is_none());
    }

    #[test]
    fn wide_differences_and_sign_flips_roundtrip() {
        let (classes, mut values) = sample(3000, 3);
        values[10] = 0x8000; // a sign flip
        values[11] = 0x1234;
        let classes4: Vec<u8> = classes.clone();
        let values4: Vec<u64> = values.iter().map(|&v| if v == 0x8000 { 0x8000_0000 } else { v | 0x10000 }).collect();
        if let Some(stream) = encode(&classes, &values, 2) {
            assert_eq!(decode::<2>(&stream, &classes).unwrap(), values);
        }
        if let Some(stream) = encode(&classes4, &values4, 4) {
            check::<4>(&stream, values4.len() as u64).unwrap();
            assert_eq!(decode::<4>(&stream, &classes4).unwrap(), values4);
        }
    }

    #[test]
    fn malformed_streams_and_wrong_classes_are_refused() {
        let (classes, values) = sample(5000, 11);
        let stream = encode(&classes, &values, 2).unwrap();
        let n = values.len() as u64;
        assert!(check::<2>(&stream, n + 1).is_err(), "a wrong change count");
        assert!(check::<2>(&stream[..stream.len() - 1], n).is_err(), "a cut stream");
        let mut longer = stream.clone();
        longer.push(0);
        assert!(check::<2>(&longer, n).is_err(), "a byte after the streams");
        for bad_groups in [0u8, 17] {
            let mut bad = stream.clone();
            bad[0] = bad_groups;
            assert!(check::<2>(&bad, n).is_err(), "{bad_groups} groups");
        }
        // Every change moved to the last class: the last group runs out while others are left over.
        let shifted = vec![15u8; classes.len()];
        assert!(decode::<2>(&stream, &shifted).is_err());
        // Each byte flipped in turn: refused, or decoded to values (a flip may land in a low bit), never a panic.
        for at in 0..stream.len().min(400) {
            let mut bad = stream.clone();
            bad[at] ^= 0x5a;
            let _ = check::<2>(&bad, n);
            let _ = decode::<2>(&bad, &classes);
        }
    }
}
