package testdriver_test

import (
	"fmt"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

func TestIdempotency(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency}, 1)
	c := d.ctrl(0)

	id := mustCreate(ctx, t, c, "pvc-1")
	if again := mustCreate(ctx, t, c, "pvc-1"); again != id {
		t.Errorf("second CreateVolume with the same name returned %s, want %s", again, id)
	}
	_, err := c.CreateVolume(ctx, createReq("pvc-1", 1<<30))
	wantCode(t, "CreateVolume same name, larger capacity", err, codes.AlreadyExists)

	for i := range 2 {
		rsp, err := c.ControllerPublishVolume(ctx, publishReq(id, "node-a", false))
		if err != nil {
			t.Fatalf("publish #%d: %v", i, err)
		}
		if rsp.GetPublishContext()[testdriver.PublishContextDevicePath] == "" {
			t.Errorf("publish #%d: no device path in publish context %v", i, rsp.GetPublishContext())
		}
	}
	_, err = c.ControllerPublishVolume(ctx, publishReq(id, "node-a", true))
	wantCode(t, "publish again with another readonly flag", err, codes.AlreadyExists)
	_, err = c.ControllerPublishVolume(ctx, publishReq(id, "node-b", false))
	wantCode(t, "publish a single-node volume to a second node", err, codes.FailedPrecondition)
	_, err = c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
	wantCode(t, "delete a published volume", err, codes.FailedPrecondition)

	for i := range 2 {
		if _, err := c.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"}); err != nil {
			t.Fatalf("unpublish #%d: %v", i, err)
		}
	}
	if _, err := c.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "vol-unknown", NodeId: "node-a"}); err != nil {
		t.Errorf("unpublish of an unknown volume: %v", err)
	}
	for i := range 2 {
		if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Fatalf("delete #%d: %v", i, err)
		}
	}
	if vols := d.b.Volumes(); len(vols) != 0 {
		t.Errorf("volumes left after delete: %+v", vols)
	}
}

func TestArgumentAndStateErrors(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency, Nodes: []string{"node-a"}}, 1)
	c := d.ctrl(0)
	id := mustCreate(ctx, t, c, "pvc-1")

	expand := func(vol string, size int64) error {
		_, err := c.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vol, CapacityRange: &csi.CapacityRange{RequiredBytes: size}})
		return err
	}
	modify := func(vol string, params map[string]string) error {
		_, err := c.ControllerModifyVolume(ctx, &csi.ControllerModifyVolumeRequest{VolumeId: vol, MutableParameters: params})
		return err
	}
	publish := func(req *csi.ControllerPublishVolumeRequest) error {
		_, err := c.ControllerPublishVolume(ctx, req)
		return err
	}
	create := func(req *csi.CreateVolumeRequest) error {
		_, err := c.CreateVolume(ctx, req)
		return err
	}
	noCaps := createReq("pvc-2", 1)
	noCaps.VolumeCapabilities = nil

	for _, tc := range []struct {
		name string
		err  error
		want codes.Code
	}{
		{"create without name", create(createReq("", 1)), codes.InvalidArgument},
		{"create without capabilities", create(noCaps), codes.InvalidArgument},
		{"publish without volume", publish(publishReq("", "node-a", false)), codes.InvalidArgument},
		{"publish without node", publish(publishReq(id, "", false)), codes.InvalidArgument},
		{"publish unknown volume", publish(publishReq("vol-00009999", "node-a", false)), codes.NotFound},
		{"publish unknown node", publish(publishReq(id, "node-x", false)), codes.NotFound},
		{"expand without volume", expand("", 1<<21), codes.InvalidArgument},
		{"expand unknown volume", expand("vol-00009999", 1<<21), codes.NotFound},
		{"modify unknown parameter", modify(id, map[string]string{"color": "red"}), codes.InvalidArgument},
		{"modify unknown volume", modify("vol-00009999", map[string]string{"iops": "5"}), codes.NotFound},
	} {
		wantCode(t, tc.name, tc.err, tc.want)
	}

	if err := expand(id, 1<<21); err != nil {
		t.Fatalf("expand: %v", err)
	}
	if err := modify(id, map[string]string{"iops": "5000"}); err != nil {
		t.Fatalf("modify: %v", err)
	}
	v, ok := d.b.Volume(id)
	if !ok || v.CapacityBytes != 1<<21 || v.MutableParameters["iops"] != "5000" {
		t.Errorf("volume after expand and modify: %+v", v)
	}
	// Calls rejected for their arguments are journaled too, already ended.
	if got := callsOf(d.b.Journal(), testdriver.MethodCreateVolume); len(got) != 3 || got[1].Code != codes.InvalidArgument.String() {
		t.Errorf("CreateVolume journal: %+v", got)
	}
}

func TestCapabilitiesSwitch(t *testing.T) {
	ctx := testCtx(t)
	caps, err := testdriver.ParseControllerCapabilities("create_delete_volume, LIST_VOLUMES")
	if err != nil {
		t.Fatalf("ParseControllerCapabilities: %v", err)
	}
	d := startDriver(t, testdriver.Config{ControllerCapabilities: caps, Topology: true}, 1)
	c := d.ctrl(0)

	rsp, err := c.ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
	if err != nil || len(rsp.GetCapabilities()) != 2 {
		t.Fatalf("ControllerGetCapabilities: %v, %v", rsp, err)
	}
	id := mustCreate(ctx, t, c, "pvc-1")
	_, err = c.ControllerPublishVolume(ctx, publishReq(id, "node-a", false))
	wantCode(t, "publish without PUBLISH_UNPUBLISH_VOLUME", err, codes.Unimplemented)
	_, err = c.GetCapacity(ctx, &csi.GetCapacityRequest{})
	wantCode(t, "GetCapacity without GET_CAPACITY", err, codes.Unimplemented)
	list, err := c.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil || len(list.GetEntries()) != 1 || list.GetEntries()[0].GetStatus() != nil {
		t.Errorf("ListVolumes without LIST_VOLUMES_PUBLISHED_NODES: %v, %v", list, err)
	}

	plugin, err := d.ident(0).GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
	if err != nil {
		t.Fatalf("GetPluginCapabilities: %v", err)
	}
	var services []csi.PluginCapability_Service_Type
	for _, pc := range plugin.GetCapabilities() {
		services = append(services, pc.GetService().GetType())
	}
	want := []csi.PluginCapability_Service_Type{
		csi.PluginCapability_Service_CONTROLLER_SERVICE,
		csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS,
	}
	if len(services) != 2 || services[0] != want[0] || services[1] != want[1] {
		t.Errorf("plugin services %v, want %v", services, want)
	}

	if _, err := testdriver.ParseControllerCapabilities("CREATE_DELETE_VOLUME,NO_SUCH_THING"); err == nil {
		t.Error("ParseControllerCapabilities accepted an unknown name")
	}
	if _, err := testdriver.New(testdriver.Config{ControllerCapabilities: []csi.ControllerServiceCapability_RPC_Type{csi.ControllerServiceCapability_RPC_GET_NODE_INFO}}); err == nil {
		t.Error("New accepted a capability the driver does not implement")
	}
}

func TestControllerServiceDisabled(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{DisableControllerService: true, DriverName: "off.example.com"}, 1)

	info, err := d.ident(0).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
	if err != nil || info.GetName() != "off.example.com" {
		t.Errorf("GetPluginInfo: %v, %v", info, err)
	}
	plugin, err := d.ident(0).GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
	if err != nil || len(plugin.GetCapabilities()) != 0 {
		t.Errorf("GetPluginCapabilities of a node-only driver: %v, %v", plugin, err)
	}
	_, err = d.ctrl(0).CreateVolume(ctx, createReq("pvc-1", 1))
	wantCode(t, "CreateVolume with the controller service off", err, codes.Unimplemented)
	_, err = d.ctrl(0).ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
	wantCode(t, "ControllerGetCapabilities with the controller service off", err, codes.Unimplemented)
}

func TestListVolumesPaging(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency}, 1)
	c := d.ctrl(0)
	var ids []string
	for i := range 5 {
		ids = append(ids, mustCreate(ctx, t, c, "pvc-"+string(rune('a'+i))))
	}
	if _, err := c.ControllerPublishVolume(ctx, publishReq(ids[1], "node-a", false)); err != nil {
		t.Fatalf("publish: %v", err)
	}

	var pages [][]string
	token := ""
	for {
		rsp, err := c.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 2, StartingToken: token})
		if err != nil {
			t.Fatalf("ListVolumes page %d: %v", len(pages), err)
		}
		var page []string
		for _, e := range rsp.GetEntries() {
			id := e.GetVolume().GetVolumeId()
			page = append(page, id)
			nodes := e.GetStatus().GetPublishedNodeIds()
			if published := len(nodes) == 1 && nodes[0] == "node-a"; published != (id == ids[1]) {
				t.Errorf("volume %s published nodes %v", id, nodes)
			}
		}
		pages = append(pages, page)
		if token = rsp.GetNextToken(); token == "" {
			break
		}
	}
	want := [][]string{ids[0:2], ids[2:4], ids[4:5]}
	if fmt.Sprint(pages) != fmt.Sprint(want) {
		t.Errorf("pages %v, want %v", pages, want)
	}

	// A token stays valid when the volume it names is deleted between pages.
	first, err := c.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 2})
	if err != nil || first.GetNextToken() != ids[2] {
		t.Fatalf("first page: %v, %v", first, err)
	}
	if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: ids[2]}); err != nil {
		t.Fatalf("delete: %v", err)
	}
	rest, err := c.ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: first.GetNextToken()})
	if err != nil || len(rest.GetEntries()) != 2 || rest.GetEntries()[0].GetVolume().GetVolumeId() != ids[3] || rest.GetNextToken() != "" {
		t.Errorf("page after a deleted token volume: %v, %v", rest, err)
	}

	_, err = c.ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: "invalid-token"})
	wantCode(t, "ListVolumes with a foreign token", err, codes.Aborted)
	_, err = c.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: -1})
	wantCode(t, "ListVolumes with negative max_entries", err, codes.InvalidArgument)
}

func TestGetCapacity(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{TotalCapacity: 3 << 20}, 1)
	c := d.ctrl(0)
	mustCreate(ctx, t, c, "pvc-1") // 1 MiB
	rsp, err := c.GetCapacity(ctx, &csi.GetCapacityRequest{})
	if err != nil || rsp.GetAvailableCapacity() != 2<<20 {
		t.Errorf("GetCapacity: %v, %v; want 2 MiB", rsp, err)
	}
	_, err = c.CreateVolume(ctx, createReq("pvc-big", 3<<20))
	wantCode(t, "CreateVolume larger than the free capacity", err, codes.ResourceExhausted)
}
