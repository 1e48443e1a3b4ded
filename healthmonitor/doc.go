// Package healthmonitor is the csi-sidecars health monitor, the counterpart of upstream
// external-health-monitor-controller v0.18 for drivers of CSI spec v1.13 and later, hosted
// by the lifecycle core.
//
// Upstream asks for volume health through ListVolumes and ControllerGetVolume and their
// volume_condition, which CSI spec v1.13 removed with the VOLUME_CONDITION capability. This
// monitor speaks the health API that replaced it:
//
//   - a driver with LIST_VOLUME_HEALTH gets one ControllerListVolumeHealth pass, over all its
//     pages, per --list-volumes-interval (upstream's interval of its ListVolumes pass); a
//     volume listed is abnormal, and once the pass is complete every other bound volume is
//     healthy;
//   - a driver with GET_VOLUME_HEALTH only gets a ControllerGetVolumeHealth per bound volume
//     per --monitor-interval, from --worker-threads workers;
//   - a driver with neither (or without the Controller service) ends the process with exit
//     code 1 and says why, as upstream exits 1.
//
// A volume's health is recorded on its claim, and only when it changed, so that a thousand
// healthy volumes cost no API write per interval: in the claim's status.healthStatus
// (conditions Inaccessible, DataLoss, Degraded) where the API server keeps that field (its
// alpha CSIVolumeHealth gate), else as upstream's events VolumeConditionAbnormal and
// VolumeConditionNormal (report.go says how the two are told apart). The status is
// compared with the cached claim, read through the monitor's own writes
// (lifecycle.OwnWrites), so a new leader writes nothing that is already current. Events
// are compared with what this process reported, so a new leader reports each abnormal
// volume once more.
//
// Every CSI call and the write that records its answer run on the core's Ops() context: a
// SIGTERM during a list lets the call in the driver finish and its answer be recorded,
// and asks for no further page (P1).
//
// With --enable-node-watcher, upstream's node events NodeFailed and NodeRecovered are
// written on the claims that Pods on a failed node use (nodes.go).
//
// The package never handles signals, Leases or process exit, and holds no package-level
// mutable state.
package healthmonitor
